"""Tests for SPS-curve profiling and its disk cache (paper §3.2.2), on a tiny random Llama."""

import json
import math

import pytest
import torch
from conftest import CYCLE_VOCAB, LLAMA_DEFAULT_TOKENS, cycle_drafter, cycle_target, tiny_llama, tiny_sps_curve
from transformers import DynamicCache

from dspark_hf import SequentialTemperatureScaling
from dspark_hf.decoding.lookup import MARGIN, plan_round
from dspark_hf.runtime import profiling, sps
from dspark_hf.runtime.profiling import (
    load_or_profile_sps,
    profile_sps,
    save_sps,
    sps_cache_path,
    time_verify_step,
)
from dspark_hf.runtime.sps import NoisySPSWarning, SPSCurve, plot_sps

KW = dict(max_tokens=4, context_len=8, contexts=(), min_repeats=2, max_repeats=2, progress=False)


pytestmark = [pytest.mark.usefixtures("one_thread"),  # real timings of a tiny model may be flagged noisy: not tested there
              pytest.mark.filterwarnings("ignore::dspark_hf.runtime.sps.NoisySPSWarning")]


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
    assert (curve.dtype, curve.context_len, curve.smoothed, curve.device_type) == ("float32", 8, False, "cpu")
    assert curve.n_params == sum(p.numel() for p in target.parameters())
    assert SPSCurve.from_json(curve.to_json()).device_type == "cpu"


def test_smooth_is_non_increasing(target):
    curve = profile_sps(target, smooth=True, cache=False, **KW)
    assert curve.smoothed
    assert all(a >= b for a, b in zip(curve.steps_per_s, curve.steps_per_s[1:]))
    raw = SPSCurve([1.0, 2.0, 0.5, 0.7], "t", "cpu", "float32", "x", 8, 1)
    assert raw.smooth().steps_per_s == [1.0, 1.0, 0.5, 0.5]


def test_a_round_reads_the_sizes_as_measured():
    """Issue #28: a CPU whose 2-row GEMM is its slow shape (ms 62, 87, 70, 66, 65, 76, as a 2-core AVX-512 EPYC
    verifies at 1 thread): a round reads B = 2 at its own cost and B = 3-5 at theirs (a concave or monotone reading
    would price them all at B = 2's), the drafter's pass added where the round drafts; the sizes the round can verify
    only. A lookup of one token with c = 0.3 does not pay at B = 2 (nor a hybrid at B = 3 or 4 with a 20 ms pass),
    three tokens with c = 0.3 each do at B = 4."""
    ms = [62.0, 87.0, 70.0, 66.0, 65.0, 76.0]
    cpu = SPSCurve([1e3 / m for m in ms], "t", "AMD EPYC AVX512", "float32", "x", 256, 1, device_type="cpu")
    assert [1e3 / r for r in cpu.round_rates(256, False, 4)] == pytest.approx([62, 87, 70, 66])
    cpu.draft_ms = 20.0
    assert [1e3 / r for r in cpu.round_rates(256, True, 2)] == pytest.approx([82, 107])
    for bad in (0, 7):
        with pytest.raises(ValueError, match=r"max_tokens must be in 1\.\.6"):
            cpu.round_rates(256, False, bad)
    rates, drafted = cpu.round_rates(256, False, 4), cpu.round_rates(256, True, 4)
    assert plan_round([0.3], [0.0] * 3, rates, 3, drafted, MARGIN)[0] == "target"  # 1.3 / 87 < 1.05 / 62
    assert plan_round([0.3] * 3, [0.0] * 3, rates, 3, drafted, MARGIN)[:3] == ("lookup", 3, 3)  # 1.417 / 66


def test_cache_round_trip(target, hf_home, monkeypatch):
    first = load_or_profile_sps(target, **KW)
    path = sps_cache_path(target, KW["context_len"])
    assert path.is_file() and path.parent == hf_home / "dspark_hf" / "sps"
    assert path.name.startswith("unnamed-float32-ctx8-")

    def no_profiling(*args, **kwargs):
        raise AssertionError("a cached curve must not be re-profiled")

    monkeypatch.setattr(profiling, "profile_sps", no_profiling)
    assert load_or_profile_sps(target, **KW) == first
    assert load_or_profile_sps(target, smooth=True, **KW) == first.smooth()
    assert load_or_profile_sps(target, **{**KW, "max_tokens": 3}) == first  # a longer stored curve serves
    assert SPSCurve.from_json(first.to_json()) == first
    monkeypatch.undo()
    monkeypatch.setenv("HF_HOME", str(hf_home))
    longer = load_or_profile_sps(target, **{**KW, "max_tokens": 5})  # a shorter one is extended
    assert longer.max_tokens == 5 and longer.steps_per_s[:4] == first.steps_per_s
    assert SPSCurve.from_json(path.read_text()) == longer


def test_verify_step_leaves_cache_length_unchanged(target):
    kv = DynamicCache(config=target.config)
    with torch.inference_mode():
        target(input_ids=torch.randint(64, (1, 8)), cache=kv, use_cache=True)
    assert time_verify_step(target, kv, torch.randint(64, (1, 3))) > 0
    assert kv.get_seq_length() == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(max_tokens=0), ">= 1"), (dict(min_repeats=1), ">= 2"), (dict(min_repeats=3, max_repeats=2), "max_repeats"),
     (dict(context_len=62, max_tokens=4), "max_position")],
)
def test_bad_arguments_raise(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        profile_sps(target, **{**KW, **kwargs})


def test_curve_rejects_bad_values():
    with pytest.raises(ValueError, match="> 0"):
        SPSCurve([1.0, 0.0], "t", "cpu", "float32", "x", 8, 1)
    with pytest.raises(ValueError, match="format_version"):
        SPSCurve.from_json('{"format_version": 99}')


def test_version_1_files_still_load():
    old = '{"format_version": 1, "steps_per_s": [10.0, 5.0], "target_name": "t", "device_name": "cpu", ' \
          '"dtype": "float32", "torch_version": "x", "context_len": 256, "n_params": 1}'
    curve = SPSCurve.from_json(old)
    assert curve.rows == {256: [10.0, 5.0]} and curve.online and not curve.noisy



def test_a_field_from_a_newer_version_is_left_out():
    """A shared cache written by a newer dspark-hf (a field this version lacks) still loads, with what it knows."""
    newer = '{"format_version": 2, "steps_per_s": [10.0, 5.0], "target_name": "t", "device_name": "cpu", ' \
            '"dtype": "float32", "torch_version": "x", "context_len": 256, "n_params": 1, "overhead_ms": 3.0, ' \
            '"a_later_field": "gpu"}'
    curve = SPSCurve.from_json(newer)
    assert curve.rows == {256: [10.0, 5.0]} and curve.overhead_ms == 3.0

# ---------------------------------------------------------------------- measurement with injected timings
def fake_timer(monkeypatch, ms_of):
    """Replace the real timing by ``ms_of(B, context, call_index)`` milliseconds; returns the call log."""
    calls = []

    def fake(target, cache, input_ids):
        calls.append((input_ids.shape[1], cache.get_seq_length()))
        return ms_of(input_ids.shape[1], cache.get_seq_length(), len(calls)) / 1e3

    monkeypatch.setattr(profiling, "time_verify_step", fake)
    return calls


def test_profile_measures_each_context_on_a_grown_cache(target, monkeypatch):
    calls = fake_timer(monkeypatch, lambda b, ctx, i: 10 + b * ctx / 8)  # cost grows with B × context
    curve = profile_sps(target, cache=False, **{**KW, "contexts": (16, 32, 61)})  # 61 + 4 > 64: skipped
    assert list(curve.rows) == [8, 16, 32]
    for ctx, row in curve.rows.items():
        assert row == pytest.approx([1e3 / (10 + b * ctx / 8) for b in range(1, 5)])
    assert {ctx for _, ctx in calls} == {8, 16, 32}  # the cache really had that many tokens
    # interpolation in milliseconds between rows, clamped outside them
    assert 1e3 / curve.at(24)[3] == pytest.approx((1e3 / curve.at(16)[3] + 1e3 / curve.at(32)[3]) / 2)
    assert curve.at(4) == curve.rows[8] and curve.at(4096) == curve.rows[32]


def test_stopping_rule_stops_early_on_steady_timings(target, monkeypatch):
    calls = fake_timer(monkeypatch, lambda b, ctx, i: 50.0)
    curve = profile_sps(target, cache=False, **{**KW, "min_repeats": 3, "max_repeats": 20})
    assert len(calls) == 4 * (1 + 3)  # warm-up + min_repeats sweeps of B = 1..4: the medians are exact
    assert not curve.noisy and curve.spread == 0.0


def test_noisy_timings_are_flagged_warned_and_cached(target, monkeypatch, hf_home):
    calls = fake_timer(monkeypatch, lambda b, ctx, i: 50.0 * (1 + 3 * ((i - 1) // 4 % 2)))  # 50 / 200 ms, sweep by sweep
    with pytest.warns(NoisySPSWarning, match="noisy"):
        curve = profile_sps(target, **{**KW, "min_repeats": 3, "max_repeats": 6})
    assert len(calls) == 4 * (1 + 6)  # never tight enough: ran to max_repeats
    assert curve.noisy and curve.spread > sps.NOISY_SPREAD
    stored = SPSCurve.from_json(sps_cache_path(target, 8).read_text())
    assert stored.noisy
    with pytest.warns(NoisySPSWarning, match="cached in"):
        load_or_profile_sps(target, **KW)
    assert "noisy" in stored.table()



def test_a_noisy_curve_that_has_healed_online_stops_warning(target, monkeypatch, hf_home):
    """Issue 26: a noisy cached curve warned on every later command, even after 169 online refinements. It stops once
    every size that rounds use was observed HEALED_AFTER (22) times; a size used rarely (< 5 %) does not count."""
    import warnings

    from dspark_hf.runtime.sps import HEALED_AFTER

    fake_timer(monkeypatch, lambda b, ctx, i: 50.0 * (1 + 3 * ((i - 1) // 4 % 2)))
    with pytest.warns(NoisySPSWarning):
        curve = profile_sps(target, **{**KW, "min_repeats": 3, "max_repeats": 6})
    assert HEALED_AFTER == 22 and (1 - 0.1) ** 22 < 0.1 < (1 - 0.1) ** 21  # the measured value's weight left
    curve.observe(4, 8, 0.05)  # one round at B = 4: a rarely used size
    for i in range(2 * HEALED_AFTER - 1):
        curve.observe(2 if i % 2 else 3, 8, 0.05)  # B = 2: 21 times, B = 3: 22 times
    assert not curve.healed
    save_sps(curve, target)
    with pytest.warns(NoisySPSWarning, match="cached in"):
        load_or_profile_sps(target, **KW)
    curve.observe(2, 8, 0.05)
    assert curve.healed
    save_sps(curve, target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoisySPSWarning)
        stored = load_or_profile_sps(target, **KW)
    assert stored.noisy and stored.healed and "healed since by 45 online refinements" in stored.table()

def test_time_budget_caps_the_sweeps(target, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock[0])

    def slow(b, ctx, i):
        clock[0] += 1.0  # each timed step "takes" one second of the fake clock
        return 50.0 * (1 + (i - 1) // 4 % 2)  # never tight

    calls = fake_timer(monkeypatch, slow)
    with pytest.warns(NoisySPSWarning):
        profile_sps(target, cache=False, **{**KW, "min_repeats": 2, "max_repeats": 100, "time_budget_s": 20.0})
    assert len(calls) == 4 * (1 + 4)  # 4 s per sweep, 20 s budget (warm-up included): stops after 4 sweeps


def test_out_of_budget_skips_further_contexts_but_not_the_primary(target, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock[0])

    def slow(b, ctx, i):
        clock[0] += 1.0
        return 50.0 * (1 + (i - 1) // 4 % 2)

    calls = fake_timer(monkeypatch, slow)
    with pytest.warns(NoisySPSWarning):
        curve = profile_sps(target, cache=False, **{**KW, "context_len": 16, "contexts": (8, 32),
                                                    "max_repeats": 100, "time_budget_s": 10.0})
    assert list(curve.rows) == [8, 16]  # 8 used the time; the primary 16 still got its 2 sweeps; 32 skipped
    assert [ctx for _, ctx in calls].count(16) == 4 * 2


def test_a_stored_curve_is_extended_to_more_tokens_keeping_its_rows(target, monkeypatch, hf_home):
    """A call that verifies more tokens than the stored curve covers (the concurrent engine, a padded batch) used to
    measure the whole curve again within the same budget, keeping fewer context rows and no online refinement. Now
    only the missing sizes are timed, at every row, in proportion to the stored curve's largest size."""
    stored = SPSCurve(steps_per_s=[100.0, 90.0, 80.0, 70.0], target_name="", device_name="cpu", dtype="float32",
                      torch_version="x", context_len=8, n_params=1,
                      context_curves={16: [60.0, 50.0, 40.0, 30.0], 61: [20.0, 18.0, 16.0, 14.0]},
                      counts={8: [5, 3, 0, 1]}, observations=9, overhead_ms=2.5, draft_ms=4.0)
    save_sps(stored, target)
    calls = fake_timer(monkeypatch, lambda b, ctx, i: 10 + b * ctx)  # the machine now (slower than the stored curve)
    curve = load_or_profile_sps(target, **{**KW, "max_tokens": 6})
    assert {b for b, _ in calls} == {4, 5, 6}  # the anchor B = 4 and the missing sizes only
    assert {ctx for _, ctx in calls} == {8, 16}  # 61 + 6 > 64 positions: not timed
    assert curve.steps_per_s == pytest.approx([100.0, 90.0, 80.0, 70.0, 70.0 * 42 / 50, 70.0 * 42 / 58])
    assert curve.context_curves[16] == pytest.approx([60.0, 50.0, 40.0, 30.0, 30.0 * 74 / 90, 30.0 * 74 / 106])
    assert curve.context_curves[61][4:] == pytest.approx([14.0 * 74 / 90, 14.0 * 74 / 106])  # the nearest timed row's
    assert curve.counts == {8: [5, 3, 0, 1, 0, 0]}
    assert (curve.observations, curve.overhead_ms, curve.draft_ms) == (9, 2.5, 4.0)
    assert SPSCurve.from_json(sps_cache_path(target, 8).read_text()) == curve


# ------------------------------------------------------------------------------------- online refinement
def wrong_curve(ms=5000.0, rows=None) -> SPSCurve:
    return SPSCurve(steps_per_s=[1e3 / ms] * 5, target_name="t", device_name="cpu", dtype="float32",
                    torch_version="x", context_len=256, n_params=1, context_curves=rows or {})


def test_observe_moves_the_curve_toward_the_measured_times():
    curve, truth = wrong_curve(), [60.0, 62.0, 64.0, 66.0, 68.0]
    for _ in range(100):
        for b in (2, 4):  # the sizes the scheduler happened to pick
            curve.observe(b, 300, truth[b - 1] / 1e3)
    ms = [1e3 / s for s in curve.steps_per_s]
    assert curve.observations == 200 and list(curve.rows) == [256]  # 300 is within a factor √2 of 256
    assert ms[1] == pytest.approx(truth[1], rel=0.02) and ms[3] == pytest.approx(truth[3], rel=0.02)
    for b in (1, 3, 5):  # never observed: moved by their neighbours from 5000 ms to the measured range
        assert 55 < ms[b - 1] < 75


def test_the_targets_token_alone_moves_only_its_own_cost():
    # issue #28: target-alone rounds (B = 1) must not pull the block sizes toward a plain step's cost
    curve = SPSCurve(steps_per_s=[1e3 / m for m in (60.0, 84.0, 70.0, 66.0)], target_name="t", device_name="cpu",
                     dtype="float32", torch_version="x", context_len=256, n_params=1)
    for _ in range(50):
        curve.observe(1, 256, 0.050)
    ms = [1e3 / s for s in curve.steps_per_s]
    assert ms[0] == pytest.approx(50.0, rel=0.01) and ms[1:] == pytest.approx([84.0, 70.0, 66.0], abs=1e-9)
    curve.observe(2, 256, 0.084)  # a block still pulls its neighbours, B = 1 included
    after = [1e3 / s for s in curve.steps_per_s]
    assert after[0] > ms[0] and after[2] > 70.0


def test_one_spike_moves_the_estimate_by_its_weight_only():
    curve = wrong_curve(ms=60.0)
    curve.observe(1, 256, 0.6)  # one 10x outlier
    assert 1e3 / curve.steps_per_s[0] == pytest.approx(60.0 * 10 ** sps.ONLINE_WEIGHT)


def test_observations_at_long_context_go_to_their_own_row():
    curve = wrong_curve(ms=50.0, rows={2048: [1e3 / 100.0] * 5})
    curve.observe(5, 7000, 0.2)  # no row within a factor √2: a new row 8192, seeded from the 2048 row (clamped)
    assert list(curve.rows) == [256, 2048, 8192]
    assert 1e3 / curve.rows[8192][4] == pytest.approx(100.0 * 2 ** sps.ONLINE_WEIGHT)
    assert curve.steps_per_s == [20.0] * 5 and curve.rows[2048] == [10.0] * 5  # other rows untouched
    curve.observe(1, 1500, 0.1)  # within a factor √2 of 2048
    assert 1e3 / curve.rows[2048][0] == pytest.approx(100.0)  # 100 ms observed at 100 ms: unchanged
    with pytest.raises(ValueError, match="1..5"):
        curve.observe(6, 256, 0.1)
    with pytest.raises(ValueError, match="seconds > 0"):
        curve.observe(1, 256, 0.0)


def test_generate_refines_a_wrong_curve_from_injected_verify_times(monkeypatch, hf_home):
    """generate() in scheduler mode feeds every round's verify time to the drafter's curve."""
    target = cycle_target(num_hidden_layers=1, alpha=0.026)
    drafter = cycle_drafter(target, "markov")
    drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * 4)
    drafter.set_sps_curve(SPSCurve(steps_per_s=[1e3 / 5000.0] * 5, target_name="t", device_name="cpu",
                                   dtype="float32", torch_version="x", context_len=32, n_params=1))
    clock = [0.0]

    def tick():  # a fake clock: every reading is 40 ms after the previous one
        clock[0] += 0.040
        return clock[0]

    from dspark_hf.decoding import candidate_generator as generation
    monkeypatch.setattr(generation.time, "perf_counter", tick)
    ids = torch.randint(CYCLE_VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=34,
                    do_sample=False, dspark_verification="scheduler")
    rounds = drafter.last_stats.rounds
    curve = drafter.sps_curve
    assert curve.observations == len(rounds) >= 8
    assert all(r.verify_ms == pytest.approx(40.0) for r in rounds)
    assert list(curve.rows) == [32]  # contexts 6..39: all within a factor √2 of 32 or below it
    start_error = math.log(5000 / 40.0)
    for b in range(1, 6):  # from 5000 ms toward the 40 ms every verification took
        n_b = sum(r.scheduled + 1 == b for r in rounds)
        error = math.log(1e3 / curve.steps_per_s[b - 1] / 40.0)
        assert 0 <= error <= (1 - sps.ONLINE_WEIGHT) ** n_b * start_error  # each own observation: × 0.9
        assert error < start_error  # unobserved sizes too: pulled by their neighbours
    assert curve.counts == {32: [sum(r.scheduled + 1 == b for r in rounds) for b in range(1, 6)]}


def test_scheduler_reads_the_row_of_the_current_context(hf_home):
    """Verification is cheap at short context and steep at long context: ℓ follows the context's row."""
    from dspark_hf.decoding.scheduler import schedule_prefix

    target = cycle_target(num_hidden_layers=1, alpha=0.026)
    drafter = cycle_drafter(target, "markov")
    drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * 4)
    flat, steep = [1e3 / m for m in (50, 51, 52, 53, 54)], [1e3 / m for m in (50, 120, 190, 260, 330)]
    curve = SPSCurve(steps_per_s=flat, target_name="t", device_name="cpu", dtype="float32", torch_version="x",
                     context_len=8, n_params=1, context_curves={24: steep}, online=False)
    drafter.set_sps_curve(curve)
    ids = torch.randint(CYCLE_VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=30,
                    do_sample=False, dspark_verification="scheduler", dspark_lookup=False)
    context, differs = ids.shape[1], 0  # the prefill step adds one token, the cache holds all but the last
    for r in drafter.last_stats.rounds:
        if r.drafted:  # the last round may have had no room to draft (the target verifies its anchor alone)
            c = drafter.calibration.apply(torch.tensor(r.confidences))
            assert r.scheduled == schedule_prefix(c, curve.at(context)[: r.drafted + 1])
            differs += r.scheduled != schedule_prefix(c, flat[: r.drafted + 1])
        context += r.accepted + 1
    assert differs > 0  # the long-context rounds verified less than the short-context row would have


def test_plot_writes_a_png(tmp_path):
    path = plot_sps(wrong_curve(rows={1024: [8.0] * 5}), tmp_path / "sps.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_sps_writes_the_cache_file(target, hf_home):
    curve = profile_sps(target, cache=False, **KW)
    curve.observe(2, 8, 0.5)
    path = save_sps(curve, target)
    assert path == sps_cache_path(target, 8) and SPSCurve.from_json(path.read_text()) == curve


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
    from dspark_hf.cli import main as cli
    from dspark_hf.cli import profile

    curve = tiny_sps_curve([20.0, 25.0])
    monkeypatch.setattr(profile, "load_cli_target", lambda args: (None, None))
    monkeypatch.setattr(profiling, "sps_cache_path", lambda target, context_len: tmp_path / "absent.json")
    monkeypatch.setattr(profiling, "load_or_profile_sps", lambda target, **kw: curve)
    cli.main(["profile", "--engine-table", "sglang", "--out", str(tmp_path / "sps.json")])
    assert json.loads((tmp_path / "sps.json").read_text()) == curve.engine_table("sglang")


def test_cli_profile_refresh_keeps_the_sizes_the_stored_curve_has(target, monkeypatch, capsys):
    """A new user's trial: after a curve was extended to B = 32 (a batch, the concurrent engine, --max-tokens 32),
    `dspark profile --refresh` measured B = 1..8 again, so the next batch measured the rest once more."""
    from dspark_hf.cli import main as cli
    from dspark_hf.cli import profile

    save_sps(wrong_curve(rows={1024: [8.0] * 5}), target)  # stored: B = 1..5 at context 256
    asked = []
    monkeypatch.setattr(profile, "load_cli_target", lambda args: (target, None))
    monkeypatch.setattr(profile, "default_max_tokens", lambda: 3)
    monkeypatch.setattr(profiling, "profile_sps", lambda target, **kw: asked.append(kw["max_tokens"]) or wrong_curve())
    for extra in ([], ["--max-tokens", "4"]):
        cli.main(["profile", "--refresh", "--json", *extra])
    cli.main(["profile", "--refresh", "--json", "--context-len", "8"])  # no stored curve at this context
    assert asked == [5, 4, 3]


def test_one_machine_description_for_the_sps_key_the_bench_and_info(capsys):
    """The SPS curve's device name, ``benchmarks.json``'s ``machine`` and ``dspark info`` read one description."""
    from dspark_hf.cli import info
    from dspark_hf.evaluation.bench_result import MachineRecord
    from dspark_hf.runtime.machine import describe_machine, device_name

    m = describe_machine()
    assert device_name(torch.device("cpu")) == (  # the CPU model and instruction set are in the key
        f"{m.cpu} {torch.backends.cpu.get_cpu_capability()} ({m.cores} cores, {torch.get_num_threads()} torch threads)")
    record = MachineRecord.current("dspark bench", "stock").to_json()
    assert list(record) == ["cpu", "cores", "torch_threads", "cuda", "torch", "transformers", "python", "platform",
                            "date", "command", "linear_kernels", "isa"]
    assert {k: record[k] for k in list(record)[:8]} == {k: getattr(m, k) for k in list(record)[:8]}
    assert record["isa"] == torch.backends.cpu.get_cpu_capability() != ""
    info.run(type("Args", (), {"json": True})())
    shown = json.loads(capsys.readouterr().out)
    assert (shown["torch"], shown["transformers"], shown["python"], shown["device"]) == (
        m.torch, m.transformers, m.python, "cuda" if torch.cuda.is_available() else "cpu")


def test_default_profile_has_a_row_per_context_users_hit():
    """256, 1k, 2k and 4k tokens of context, one row each (issue #23); the scheduler interpolates between them."""
    target = tiny_llama(64, 32, 1, max_position_embeddings=4200, **LLAMA_DEFAULT_TOKENS)
    curve = profile_sps(target, max_tokens=2, min_repeats=2, max_repeats=2, cache=False, progress=False)
    assert list(curve.rows) == [256, 1024, 2048, 4096] == list(sps.DEFAULT_CONTEXTS)
    ms = {c: 1e3 / row[0] for c, row in curve.rows.items()}
    assert 1e3 / curve.at(1536)[0] == pytest.approx((ms[1024] + ms[2048]) / 2)  # linear in ms between rows
