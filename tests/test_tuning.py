"""Kernel choices stored on disk (dspark_hf.runtime.tuning): measured once per machine and thread count, read back by
later processes without timing, never shared between machines or thread counts, measured again where the stored
file is unreadable, and dropped by ``dspark profile --refresh``. A fake clock stands in for the timings; a "new
process" is this one with its remembered choices cleared."""

import dataclasses
import json

import pytest
import torch

from dspark_hf import defaults
from dspark_hf.cli import main as cli
from dspark_hf.cli import profile
from dspark_hf.runtime import tuning

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = ("attention-test", 1, 9, 3, 64, torch.float32)  # what faster's callers pass: a name, shapes, a dtype


class _FakeClock:
    """Stands in for ``time`` in tuning.py; :meth:`kernels` builds kernels that each advance it by their
    milliseconds and record their index when called."""

    def __init__(self):
        self.now, self.calls = 0.0, []

    def perf_counter(self):
        return self.now

    def kernels(self, *ms):
        def make():
            return [self._kernel(i, m) for i, m in enumerate(ms)]
        return make

    def _kernel(self, index, ms):
        def run():
            self.calls.append(index)
            self.now += 1e-3 * ms
        return run


def _not_timed():
    raise AssertionError("a stored choice must be read, not measured")


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty HF_HOME that tuning's store follows (undoing conftest's redirect), a fake clock, and no remembered
    choices."""
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "cache_root", defaults.cache_root)
    monkeypatch.setattr(tuning, "_CHOICES", {})
    return tmp_path


@pytest.fixture
def clock(monkeypatch):
    fake = _FakeClock()
    monkeypatch.setattr(tuning, "time", fake)
    return fake


def _new_process(monkeypatch):
    monkeypatch.setattr(tuning, "_CHOICES", {})


def test_a_choice_measured_once_is_read_back_by_a_new_process(hf_home, clock, monkeypatch):
    """The first process times both kernels (8 interleaved calls each) and stores the faster one's index with its
    medians under $HF_HOME/dspark_hf/kernels/<machine>/; a later one reads it without building or calling a kernel,
    even where timing again would now pick the other."""
    assert tuning.faster(KEY, clock.kernels(3.0, 2.0)) == 1
    assert clock.calls == [0, 1] * (tuning.TUNE_REPEATS + 1)
    [path] = (hf_home / "dspark_hf" / "kernels").glob("*/*.json")
    assert path.parent == tuning.choices_dir() and path.name.startswith("attention-test-")
    record = json.loads(path.read_text())
    assert (record["key"], record["choice"], record["median_ms"]) == (
        ["attention-test", "1", "9", "3", "64", "torch.float32", "1"], 1, pytest.approx([3.0, 2.0]))
    _new_process(monkeypatch)
    assert tuning.faster(KEY, _not_timed) == 1
    _new_process(monkeypatch)
    assert tuning.faster(KEY, clock.kernels(2.0, 3.0)) == 1 and len(clock.calls) == 2 * (tuning.TUNE_REPEATS + 1)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize("other", ["threads", "isa", "cpu", "cores", "torch", "HF_HOME"])
def test_another_thread_count_or_machine_measures_its_own_choice(other, hf_home, clock, monkeypatch, tmp_path):
    """A choice stored at 1 thread on this machine is not read at 2 threads, on a CPU of another instruction set,
    model or core count, under another torch, nor from another HF_HOME: each measures (and stores) its own, and
    this one's stays as it was."""
    assert tuning.faster(KEY, clock.kernels(3.0, 2.0)) == 1
    _new_process(monkeypatch)
    here = tuning.describe_machine
    if other == "threads":
        torch.set_num_threads(2)  # the module's one_thread fixture restores its own value at the end
    elif other == "HF_HOME":
        monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    else:
        machine = here()
        changed = {"isa": "AVX512" if machine.isa == "AVX2" else "AVX2", "cpu": machine.cpu + " v2", "cores": (machine.cores or 1) + 1,
                   "torch": machine.torch + ".post1"}[other]
        monkeypatch.setattr(tuning, "describe_machine", lambda: dataclasses.replace(here(), **{other: changed}))
    timed = len(clock.calls)
    assert tuning.faster(KEY, clock.kernels(2.0, 3.0)) == 0 and len(clock.calls) == 2 * timed
    torch.set_num_threads(1)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setattr(tuning, "describe_machine", here)
    _new_process(monkeypatch)
    assert tuning.faster(KEY, _not_timed) == 1


@pytest.mark.parametrize("stored", ["{not json", "", '["a list"]', '{"choice": 1}', "wrong key", "choice out of range",
                                    "choice as text", "choice true"])
def test_an_unreadable_stored_choice_is_measured_again_and_rewritten_with_a_warning(stored, hf_home, clock, monkeypatch):
    """A truncated, empty or foreign file, or one whose choice is not an index of its kernels, is neither trusted nor
    fatal: a warning names the file, the choice is measured again and the file rewritten, which the next process
    reads silently."""
    tuning.faster(KEY, clock.kernels(3.0, 2.0))
    [path] = tuning.choices_dir().glob("*.json")
    record = json.loads(path.read_text())
    edits = {"wrong key": {"key": record["key"][:-1] + ["2"]}, "choice out of range": {"choice": 2},
             "choice as text": {"choice": "1"}, "choice true": {"choice": True}}
    path.write_text(json.dumps({**record, **edits[stored]}) if stored in edits else stored)
    _new_process(monkeypatch)
    with pytest.warns(UserWarning, match=f"stored kernel choice {path} is unreadable.*measuring it again"):
        assert tuning.faster(KEY, clock.kernels(2.0, 3.0)) == 0
    assert json.loads(path.read_text())["choice"] == 0
    _new_process(monkeypatch)
    assert tuning.faster(KEY, _not_timed) == 0


def test_a_store_that_cannot_be_written_warns_and_keeps_the_choice(hf_home, clock, monkeypatch):
    """An HF_HOME that cannot hold the folder (here a file): the measured choice is used, with a warning that the next
    process measures it again."""
    (hf_home / "dspark_hf").write_text("not a folder")
    with pytest.warns(UserWarning, match="Could not store the kernel choice"):
        assert tuning.faster(KEY, clock.kernels(3.0, 2.0)) == 1
    assert tuning.faster(KEY, _not_timed) == 1  # remembered by this process


class _Loaded(Exception):
    """Stops ``dspark profile`` once its target would be loaded."""


@pytest.mark.parametrize("refresh", [False, True])
def test_profile_refresh_measures_the_kernel_choices_again(refresh, hf_home, clock, monkeypatch):
    """``dspark profile --refresh`` drops this machine's stored choices at its --threads before the target loads (its
    kernels are chosen while it loads), so they are measured again; other thread counts' stay stored. Without
    --refresh the stored choice is read."""
    assert tuning.faster(KEY, clock.kernels(3.0, 2.0)) == 1
    torch.set_num_threads(2)
    assert tuning.faster(KEY, clock.kernels(3.0, 2.0)) == 1
    torch.set_num_threads(1)
    _new_process(monkeypatch)
    chosen = []

    def load(args):
        chosen.append(tuning.faster(KEY, clock.kernels(2.0, 3.0)))
        raise _Loaded

    monkeypatch.setattr(profile, "load_cli_target", load)
    with pytest.raises(_Loaded):
        cli.main(["profile", "--threads", "1"] + ["--refresh"] * refresh)
    assert chosen == [0 if refresh else 1]
    torch.set_num_threads(2)
    _new_process(monkeypatch)
    assert tuning.faster(KEY, _not_timed) == 1
    torch.set_num_threads(1)


def test_forget_choices_drops_what_this_process_remembers_at_its_thread_count(hf_home, clock):
    """forget_choices empties this machine's folder at torch's thread count and the process's own choices at that
    count, so a model already loaded measures its attention choices again on its next forward."""
    tuning.faster(KEY, clock.kernels(3.0, 2.0))
    torch.set_num_threads(2)
    tuning.faster(KEY, clock.kernels(3.0, 2.0))
    torch.set_num_threads(1)
    assert tuning.forget_choices() == tuning.choices_dir() and not list(tuning.choices_dir().glob("*.json"))
    assert tuning.faster(KEY, clock.kernels(2.0, 3.0)) == 0
    torch.set_num_threads(2)
    assert tuning.faster(KEY, _not_timed) == 1
    torch.set_num_threads(1)
