"""Routing is installed at a documented point and labelled as ours; each call's statistics are its own, per thread;
the SPS curve is resolved before the assisted loop, not by the candidate generator's constructor (issue 27)."""

import subprocess
import sys
import threading

import pytest
import torch
from conftest import cycle_drafter, cycle_target, tiny_sps_curve
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

import dspark_hf
from dspark_hf import SequentialTemperatureScaling
from dspark_hf.decoding import candidate_generator, routing
from dspark_hf.decoding.candidate_generator import DSparkCandidateGenerator
from dspark_hf.modeling.state import BoundTarget
from dspark_hf.runtime import profiling
from dspark_hf.runtime.capture import LayerCapture

pytestmark = pytest.mark.usefixtures("one_thread")

# every module of the package, imported one by one; optional extras (gradio...) may be missing
LEAF_IMPORTS = """
import importlib, pkgutil, sys
from transformers import GenerationConfig, GenerationMixin
stock = {n: getattr(GenerationMixin, n) for n in ("_get_candidate_generator", "_validate_generation_mode", "_assisted_decoding")}
import dspark_hf
imported = []
for info in pkgutil.walk_packages(dspark_hf.__path__, "dspark_hf."):
    if ".templates" in info.name or info.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as err:
        if err.name.split(".")[0] == "dspark_hf":
            raise
        continue
    imported.append(info.name)
patched = [n for n, m in stock.items() if getattr(GenerationMixin, n) is not m]
print(len(imported), "dspark_hf.metrics" in imported, "dspark_hf.decoding.scheduler" in imported,
      "dspark_hf.decoding.routing" in imported, patched or "none", hasattr(GenerationConfig, "dspark_verification"))
"""


def test_importing_any_module_patches_nothing():
    """`import dspark_hf.metrics` (or any other module, routing included) leaves transformers untouched."""
    proc = subprocess.run([sys.executable, "-c", LEAF_IMPORTS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, metrics, scheduler, routing_module, patched, config_fields = proc.stdout.split()
    assert int(count) > 40 and metrics == scheduler == routing_module == "True"
    assert patched == "none" and config_fields == "False"


def test_installed_methods_are_labelled_as_ours_and_reach_the_stock_ones():
    dspark_hf.wire()
    assert routing.is_installed()
    for name in ("_get_candidate_generator", "_validate_generation_mode", "_assisted_decoding"):
        method = getattr(GenerationMixin, name)
        assert method.__module__ == "dspark_hf.decoding.routing" and method.__qualname__ == name
        assert method.__wrapped__ is routing.stock(name) and method is not routing.stock(name)
        assert routing.stock(name).__module__ == "transformers.generation.utils"
        assert "dspark_hf's replacement" in method.__doc__
    try:
        dspark_hf.uninstall()
        assert not routing.is_installed()
        assert GenerationMixin._assisted_decoding is routing.stock("_assisted_decoding")
        assert not hasattr(GenerationConfig, "dspark_verification")
    finally:
        routing.install()
    assert routing.is_installed()


# ------------------------------------------------------------------------------------ declared state
@pytest.fixture(scope="module")
def target():
    return cycle_target(2, alpha=0.9).eval()


@pytest.fixture
def drafter(target):
    return cycle_drafter(target)


def test_bound_target_is_one_typed_object_outside_the_module_tree(target, drafter):
    assert drafter.bound is None and not drafter.is_bound
    drafter.bind(target)
    bound = drafter.bound
    assert isinstance(bound, BoundTarget) and bound.model is target and bound.embed is target.get_input_embeddings()
    assert torch.equal(bound.rows, target.get_output_embeddings().weight)  # V' = V: every lm_head row
    assert drafter.bind(target).bound is bound  # binding the same target twice is free
    assert not any(name.startswith("bound") for name, _ in drafter.named_modules())
    assert not any(k.startswith("bound") for k in drafter.state_dict())


class _MeetAfterFirstRound(BaseStreamer):
    """Waits, at its call's first generated chunk, until the other thread's call has started decoding too."""

    def __init__(self, barrier):
        self.barrier, self.puts = barrier, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.barrier.wait(timeout=120)

    def end(self):
        pass


def test_two_threads_sharing_a_drafter_each_see_their_own_stats(target, drafter):
    """Both calls run at once on one drafter: each thread's `last_stats` is its own call's, the object its output
    carries, and counts its own tokens (a shared attribute would show the later call's in both threads); a thread
    that ran none reads the latest call's."""
    barrier = threading.Barrier(2)
    prompts = {"a": torch.tensor([[5, 9, 3]]), "b": torch.tensor([[7, 1, 4, 8, 2]])}
    budgets = {"a": 9, "b": 17}
    seen, errors = {}, []

    def work(name):
        try:
            out = target.generate(prompts[name], max_new_tokens=budgets[name], do_sample=False, assistant_model=drafter,
                                  dspark_verification="fixed", return_dict_in_generate=True,
                                  streamer=_MeetAfterFirstRound(barrier))
            seen[name] = (out, drafter.last_stats)
        except Exception as err:  # reported below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(name,)) for name in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    (out_a, stats_a), (out_b, stats_b) = seen["a"], seen["b"]
    assert stats_a is not stats_b and stats_a is out_a.dspark_stats and stats_b is out_b.dspark_stats
    assert drafter.last_stats in (stats_a, stats_b)  # this thread ran none: the latest call's, from either thread
    drafter.last_stats = stats_a
    assert drafter.last_stats is stats_a
    drafter.last_stats = None  # forgets this thread's: the latest call's again
    assert drafter.last_stats in (stats_a, stats_b)
    for name, (out, stats) in seen.items():
        plain = target.generate(prompts[name], max_new_tokens=budgets[name], do_sample=False)
        assert torch.equal(out.sequences, plain)
        assert stats.new_tokens == out.sequences.shape[1] - prompts[name].shape[1] == budgets[name]


def test_dict_output_carries_the_call_statistics_and_tuples_are_unchanged(target, drafter):
    ids = torch.tensor([[5, 9, 3]])
    out = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=drafter,
                          dspark_verification="fixed", return_dict_in_generate=True)
    assert out.dspark_stats is drafter.last_stats and out.dspark_stats.new_tokens == 8
    assert "dspark_stats" not in out.keys() and len(out.to_tuple()) == len(out.keys())


# -------------------------------------------------------------------------------------- SPS resolution
def _scheduled(drafter):
    drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * drafter.config.block_size)
    return drafter


def test_the_candidate_generator_never_measures(target, drafter, monkeypatch):
    """Constructing the generator without a curve raises instead of profiling; prepare_call resolves it."""
    calls = []
    monkeypatch.setattr(profiling, "load_or_profile_sps", lambda t, **kw: calls.append(kw) or tiny_sps_curve())
    drafter = _scheduled(drafter)
    config = GenerationConfig(max_length=20, do_sample=False, dspark_verification="scheduler", dspark_lookup=False)
    ids = torch.tensor([[5, 9, 3]])
    with pytest.raises(RuntimeError, match="prepare_call"):
        DSparkCandidateGenerator(target, drafter, config, LogitsProcessorList(), ids)
    assert calls == [] and drafter.sps_curve is None
    settings = candidate_generator.prepare_call(target, drafter, config)
    assert settings.needs_sps and calls == [{"max_tokens": drafter.config.block_size + 1}]
    assert drafter.sps_curve is not None
    with LayerCapture(target, drafter.config.target_layer_ids):  # as generate runs it
        DSparkCandidateGenerator(target, drafter, config, LogitsProcessorList(), ids)  # now it has its curve
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="assistant_model=drafter"):  # outside generate: no capture to read
        DSparkCandidateGenerator(target, drafter, config, LogitsProcessorList(), ids)


def test_generate_resolves_the_curve_once_and_a_set_curve_is_used(target, drafter, monkeypatch):
    calls = []
    monkeypatch.setattr(profiling, "load_or_profile_sps", lambda t, **kw: calls.append(kw) or tiny_sps_curve())
    drafter = _scheduled(drafter)
    ids = torch.tensor([[5, 9, 3]])
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    for _ in range(2):
        out = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter,
                              dspark_verification="scheduler")
        assert torch.equal(out, plain)
    assert len(calls) == 1  # the first call resolved it; the second reads the drafter's

    fresh = _scheduled(cycle_drafter(target))
    fresh.set_sps_curve(tiny_sps_curve())
    out = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=fresh, dspark_verification="async")
    assert torch.equal(out, plain) and len(calls) == 1  # a curve set beforehand: nothing loaded or measured
    fixed = cycle_drafter(target)
    target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=fixed, dspark_verification="fixed")
    assert fixed.sps_curve is None and len(calls) == 1  # fixed reads no curve
