"""The GPU device job's staging (scripts/gpu_job.py, issue #22): parts arrive over two calls, in either order, and
are checked against parts.json; the job runs only once every part is there. Runs without a GPU."""

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def job(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_job", ROOT / "scripts" / "gpu_job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path / "repo")
    monkeypatch.setattr(module, "STAGE", tmp_path / "stage")
    return module


def carry(job, parts: dict[str, bytes], calls: dict[str, str], carried: str) -> None:
    """The working tree of one call: ``.device-stage/<carried>`` with its parts and the shared parts.json."""
    manifest = {"parts": [{"name": n, "call": calls[n], "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                          for n, b in parts.items()]}
    folder = job.ROOT / ".device-stage" / carried
    folder.mkdir(parents=True)
    (folder / "parts.json").write_text(json.dumps(manifest))
    for name, data in parts.items():
        if calls[name] == carried:
            (folder / name).write_bytes(data)


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_parts_complete_after_both_calls_in_either_order(job, order):
    parts, calls = {"gguf.part1": b"first", "gguf.part2": b"second", "wheels.tar.xz": b"w"}, \
        {"gguf.part1": "a", "gguf.part2": "b", "wheels.tar.xz": "b"}
    carry(job, parts, calls, order[0])
    _, missing = job.stage()
    assert missing == sorted(f"{n} (call {c})" for n, c in calls.items() if c == order[1])
    shutil.rmtree(job.ROOT)  # the next call sends a fresh tree; the stage stays (a warm machine)
    carry(job, parts, calls, order[1])
    manifest, missing = job.stage()
    assert missing == [] and {p["name"] for p in manifest["parts"]} == set(parts)
    assert (job.STAGE / "parts" / "gguf.part2").read_bytes() == b"second"


def test_a_corrupt_part_is_dropped_and_named(job):
    parts, calls = {"gguf.part1": b"first", "gguf.part2": b"second"}, {"gguf.part1": "a", "gguf.part2": "b"}
    carry(job, parts, calls, "a")
    (job.STAGE / "parts").mkdir(parents=True)
    (job.STAGE / "parts" / "gguf.part2").write_bytes(b"secont")  # a broken copy left by an earlier call
    _, missing = job.stage()
    assert missing == ["gguf.part2 (call b)"] and not (job.STAGE / "parts" / "gguf.part2").exists()


def test_nothing_carried_names_the_manifest(job):
    job.ROOT.mkdir()
    assert job.stage() == (None, ["parts.json"])


def test_phase_limits_fit_one_device_command(job):
    """A device command runs at most 600 s: the fixed phases, the pack reserve and a training minute fit in
    JOB_SECONDS, which leaves the staging (GGUF, wheels) a minute of that."""
    fixed = sum(limit for _, limit in job.PHASES if limit is not None)
    assert [name for name, limit in job.PHASES if limit is None] == ["train"]
    assert fixed + job.PACK_RESERVE + 60 <= job.JOB_SECONDS <= 540


def test_phases_load_models_without_the_kernels_package(job, tmp_path, monkeypatch):
    """The device has no ``kernels`` package: transformers >= 5.25 refuses to load a model without it unless Hub
    kernels are switched off, as the phases' environment does."""
    import transformers
    from conftest import tiny_llama
    from packaging.version import Version
    from transformers import LlamaForCausalLM, modeling_utils

    tiny_llama(64, 32, 1).save_pretrained(tmp_path / "tiny")
    monkeypatch.setattr(modeling_utils, "is_kernels_available", lambda *args, **kwargs: False, raising=False)
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    if Version(transformers.__version__) >= Version("5.25"):
        with pytest.raises(ValueError, match="Kernels are not available"):
            LlamaForCausalLM.from_pretrained(tmp_path / "tiny")
    monkeypatch.setenv("USE_HUB_KERNELS", job.phase_env()["USE_HUB_KERNELS"])
    assert LlamaForCausalLM.from_pretrained(tmp_path / "tiny").config.hidden_size == 32
