"""Tests for SPS-curve profiling and its disk cache (paper §3.2.2), on a tiny random Llama."""

import json

import pytest
import torch
from transformers import DynamicCache

from conftest import LLAMA_DEFAULT_TOKENS, tiny_llama, tiny_sps_curve
from dspark_hf import profiling
from dspark_hf.profiling import SPSCurve, load_or_profile_sps, profile_sps, sps_cache_path, time_verify_step

KW = dict(max_tokens=4, context_len=8, repeats=1, progress=False)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(64, 32, 2, max_position_embeddings=64, **LLAMA_DEFAULT_TOKENS)


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    return tmp_path


def test_profile_curve_shape_and_metadata(target):
    curve = profile_sps(target, cache=False, **KW)
    assert curve.max_tokens == 4
    assert all(s > 0 for s in curve.steps_per_s)
    assert (curve.dtype, curve.context_len, curve.smoothed) == ("float32", 8, False)
    assert curve.n_params == sum(p.numel() for p in target.parameters())


def test_smooth_is_non_increasing(target):
    curve = profile_sps(target, smooth=True, cache=False, **KW)
    assert curve.smoothed
    assert all(a >= b for a, b in zip(curve.steps_per_s, curve.steps_per_s[1:]))
    raw = SPSCurve([1.0, 2.0, 0.5, 0.7], "t", "cpu", "float32", "x", 8, 1)
    assert raw.smooth().steps_per_s == [1.0, 1.0, 0.5, 0.5]


def test_cache_round_trip(target, hf_home, monkeypatch):
    first = load_or_profile_sps(target, **KW)
    path = sps_cache_path(target, KW["max_tokens"], KW["context_len"])
    assert path.is_file() and path.parent == hf_home / "dspark_hf" / "sps"
    assert path.name.startswith("unnamed-float32-ctx8-b4-")

    def no_profiling(*args, **kwargs):
        raise AssertionError("a cached curve must not be re-profiled")

    monkeypatch.setattr(profiling, "profile_sps", no_profiling)
    assert load_or_profile_sps(target, **KW) == first
    assert load_or_profile_sps(target, smooth=True, **KW) == first.smooth()
    assert SPSCurve.from_json(first.to_json()) == first


def test_verify_step_leaves_cache_length_unchanged(target):
    kv = DynamicCache(config=target.config)
    with torch.inference_mode():
        target(input_ids=torch.randint(64, (1, 8)), cache=kv, use_cache=True)
    assert time_verify_step(target, kv, torch.randint(64, (1, 3))) > 0
    assert kv.get_seq_length() == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(max_tokens=0), ">= 1"), (dict(repeats=0), ">= 1"), (dict(context_len=62, max_tokens=4), "max_position")],
)
def test_bad_arguments_raise(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        profile_sps(target, **{**KW, **kwargs})


def test_curve_rejects_bad_values():
    with pytest.raises(ValueError, match="> 0"):
        SPSCurve([1.0, 0.0], "t", "cpu", "float32", "x", 8, 1)
    with pytest.raises(ValueError, match="format_version"):
        SPSCurve.from_json('{"format_version": 99}')


def test_engine_tables():
    """SGLang's --speculative-dspark-sps-table-path JSON and TensorRT-LLM's cost table, from the same curve."""
    curve = tiny_sps_curve([20.0, 25.0, 40.0])  # ms per step
    assert curve.engine_table("sglang") == {"sample_batch_tokens": [1, 2, 3], "sample_steps_per_sec": [50.0, 40.0, 25.0],
                                            "max_batch_tokens": 3}
    assert curve.engine_table("tensorrt-llm") == {"token_counts": [1, 2, 3], "step_time_ms": [20.0, 25.0, 40.0],
                                                  "fixed_overhead_ms": 0.0}
    with pytest.raises(ValueError, match="engine must be one of"):
        curve.engine_table("vllm")


def test_cli_profile_writes_the_engine_table(tmp_path, monkeypatch):
    from dspark_hf import cli

    curve = tiny_sps_curve([20.0, 25.0])
    monkeypatch.setattr(cli, "load_cli_target", lambda args: (None, None))
    monkeypatch.setattr(profiling, "load_or_profile_sps", lambda target, **kw: curve)
    cli.main(["profile", "--engine-table", "sglang", "--out", str(tmp_path / "sps.json")])
    assert json.loads((tmp_path / "sps.json").read_text()) == curve.engine_table("sglang")
