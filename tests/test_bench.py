"""`dspark bench`: the metrics on hand-made round statistics, and a tiny end-to-end run of the runner.

The metric tests use values worked out by hand in the comments. The smoke test runs all three passes on a tiny
random Llama target with three tiny drafters (markov + confidence, rnn + confidence, parallel without
confidence) on prompts given as raw ids, then writes the JSON, Markdown and PNGs.
"""

import json
import math

import pytest
import torch
from conftest import CPU_MS, tiny_llama, tiny_sps_curve

import dspark_hf  # noqa: F401  (routes DSpark drafters through DSparkCandidateGenerator)
from dspark_hf import DSparkConfig, DSparkDrafter, SequentialTemperatureScaling
from dspark_hf.bench import loading, report, wall_clock
from dspark_hf.bench import runner as bench
from dspark_hf.bench import suites as suites_mod
from dspark_hf.bench.analysis import first_divergence
from dspark_hf.cli import bench as bench_cli
from dspark_hf.decoding.stats import GenerationStats, RoundStats, full_rounds
from dspark_hf.evaluation.bench_result import BenchResult
from dspark_hf.evaluation.runs import Run
from dspark_hf.sources.categories import is_math_problem

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------- metrics
def test_tau_includes_the_bonus_token():
    assert bench.tau([0, 3, 7, 2]) == 4.0  # (1 + 4 + 8 + 3) / 4
    assert bench.tau([]) is None


def test_conditional_acceptance():
    # rounds reaching position k (n >= k): k=0: 5, 1: 4, 2: 3, 3: 2, 4: 2
    assert bench.conditional_acceptance([0, 1, 4, 2, 4], 4) == pytest.approx([4 / 5, 3 / 4, 2 / 3, 1.0])
    assert bench.conditional_acceptance([0, 0], 2) == [0.0, None]  # nobody reached position 1


def test_threshold_sweep_and_best_threshold():
    confidences = [[0.9, 0.8, 0.3], [0.5, 0.95, 0.9]]
    accepted = [2, 3]
    step_seconds = [0.1, 0.2, 0.2, 0.3]  # a round verifying ℓ drafts
    rows = bench.threshold_sweep(confidences, accepted, [0.0, 0.6, 0.85], step_seconds)
    # t = 0: ℓ = [3, 3], kept = [2, 3]
    assert rows[0]["accepted_per_step"] == pytest.approx(3.5)  # (3 + 4) / 2
    assert rows[0]["rejected_per_step"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert rows[0]["verified_per_step"] == pytest.approx(3.0)
    assert rows[0]["acceptance_rate"] == pytest.approx(7 / 8)  # Σ(kept + 1) / Σ(ℓ + 1)
    assert rows[0]["draft_acceptance_rate"] == pytest.approx(5 / 6)
    assert rows[0]["modelled_tokens_per_s"] == pytest.approx(7 / 0.6)
    # t = 0.6: ℓ = [2, 0] (0.5 < 0.6 stops the second round at once), kept = [2, 0]
    assert rows[1]["accepted_per_step"] == pytest.approx(2.0)
    assert rows[1]["rejected_per_step"] == 0.0
    assert rows[1]["acceptance_rate"] == pytest.approx(1.0)
    assert rows[1]["modelled_tokens_per_s"] == pytest.approx(4 / 0.3)
    # t = 0.85: ℓ = [1, 0], kept = [1, 0]
    assert rows[2]["accepted_per_step"] == pytest.approx(1.5)
    assert rows[2]["modelled_tokens_per_s"] == pytest.approx(3 / 0.3)
    assert bench.best_threshold(rows) == 0.6
    assert bench.threshold_sweep([], [], [0.0])[0]["accepted_per_step"] is None


def test_confidence_summary_ece_and_auc():
    # a_1 = c_1, a_2 = c_1 c_2 = [0.45, 0.45, 0.2, 0.2]; survival labels k=1: [1, 1, 0, 0], k=2: [1, 0, 0, 0]
    confidences = [[0.9, 0.5], [0.9, 0.5], [0.2, 1.0], [0.2, 1.0]]
    accepted = [2, 1, 0, 0]
    summary = bench.confidence_summary(confidences, accepted, SequentialTemperatureScaling([1.0, 1.0]))
    p1, p2 = summary["positions"]
    # 15 bins: k=1: bins of 0.9 and 0.2 hold half each: 0.5 |0.9 - 1| + 0.5 |0.2 - 0| = 0.15
    assert p1["ece_before"] == pytest.approx(0.15)
    # k=2: 0.5 |0.45 - 0.5| + 0.5 |0.2 - 0| = 0.125
    assert p2["ece_before"] == pytest.approx(0.125)
    assert p2["ece_after"] == pytest.approx(0.125)  # identity STS
    assert summary["mean_ece_before"] == pytest.approx((0.15 + 0.125) / 2)
    # k=1: all 4 rounds count; positives score 0.9, negatives 0.2 -> AUC 1
    assert p1["roc_auc"] == pytest.approx(1.0)
    # k=2: rounds with n >= 1: c_2 = [0.5 (label 1), 0.5 (label 0)] -> a tie -> AUC 0.5
    assert p2["roc_auc"] == pytest.approx(0.5) and p2["n_conditional"] == 2
    assert bench.confidence_summary([], [], SequentialTemperatureScaling([1.0])) is None


def test_full_rounds_drop_partial_and_last_rounds():
    stats = GenerationStats(rounds=[
        RoundStats(drafted=3, scheduled=3, accepted=1, confidences=[0.9, 0.5, 0.1]),
        RoundStats(drafted=3, scheduled=2, accepted=2, confidences=[0.9, 0.9, 0.1]),  # pruned: not full
        RoundStats(drafted=3, scheduled=3, accepted=3, confidences=[0.8, 0.8, 0.8]),
        RoundStats(drafted=3, scheduled=3, accepted=0, confidences=[0.1, 0.1, 0.1]),  # last: dropped
    ])
    lookup = GenerationStats(rounds=[
        RoundStats(drafted=3, scheduled=3, accepted=3, confidences=[0.7, 0.7, 0.7], lookup=1),  # lookup: not full
        RoundStats(drafted=2, scheduled=2, accepted=2, confidences=[0.6, 0.6]),  # γ = 2: not this γ
        RoundStats(drafted=3, scheduled=3, accepted=2, confidences=[0.5, 0.5, 0.5]),
        RoundStats(drafted=3, scheduled=3, accepted=3, confidences=[0.4, 0.4, 0.4]),  # last: dropped
    ])
    accepted, confs = full_rounds([stats, lookup], 3)  # pooled, in order: (accepted, confidences)
    assert accepted == [1, 3, 2]
    assert confs == [[0.9, 0.5, 0.1], [0.8, 0.8, 0.8], [0.5, 0.5, 0.5]]
    no_head = GenerationStats(rounds=[RoundStats(drafted=3, scheduled=3, accepted=a) for a in (1, 2, 0)])
    assert full_rounds([no_head], 3) == ([1, 2], [])  # a drafter without a confidence head
    assert full_rounds([no_head], 2) == ([], [])


def test_small_helpers(tmp_path):
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert loading.parse_drafters("a=x, b=/y/z") == {"a": "x", "b": "/y/z"}
    with pytest.raises(ValueError):
        loading.parse_drafters("a")
    assert is_math_problem("What's the square root of pi")
    assert is_math_problem("Solve for x: 3x + 2 = 11")
    assert not is_math_problem("Tell me how to write a marketing strategy for 2023/24")
    assert not is_math_problem("Write a python function that adds 2 + 2")
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "hi"}\n\n{"prompt": "yo", "id": "x"}\n')
    assert suites_mod.read_prompts_file(file) == [("1", "hi"), ("x", "yo")]


class _CharTokenizer:
    """A chat template of one token per 4 characters of content (what ``encode_suites`` needs of a tokenizer)."""

    def apply_chat_template(self, messages, **kwargs):
        return [0] * (sum(len(m["content"]) for m in messages) // 4)


def test_long_suite_is_held_out_conversations_in_its_token_window():
    from dspark_hf.sources.sharegpt import conversation_key, split_of

    prompts = suites_mod.long_prompts()
    kinds = [record_id.split(":")[0] for record_id, _ in prompts]
    assert kinds[:4] == ["doc", "turns", "doc", "turns"] and len(prompts) >= 12
    assert len({conversation_key(record_id.split(":", 1)[1]) for record_id, _ in prompts}) == len(prompts)
    for record_id, messages in prompts:
        assert split_of(record_id.split(":", 1)[1]) == "test"  # never trained, validated or calibrated on
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2) + ["user"]
        assert len(messages) == 1 if record_id.startswith("doc:") else len(messages) >= 5
    encoded, skipped = suites_mod.encode_suites(_CharTokenizer(), {"long": prompts, "chat": [("c", "x" * 2000)]},
                                                limit=6, max_prompt_tokens=320)
    assert len(encoded["long"]) == 6 and all(1500 <= len(ids) <= 3500 for _, ids in encoded["long"])
    assert encoded["chat"] == [] and skipped["chat"] == 1  # the other suites keep --max-prompt-tokens
    with pytest.raises(ValueError, match="unknown suites"):
        suites_mod.suite_texts(["longer"])


def test_timed_generate_times_every_forward():
    """The forward clock sees the prefill and one forward per plain step or per speculative round."""
    from dspark_hf.evaluation.runs import timed_generate

    target = tiny_llama(V, D, 2, intermediate_size=96, head_dim=16, max_position_embeddings=512)
    plain = timed_generate(target, [5, 6, 7, 8], 10)
    assert len(plain.tokens) == 10 and len(plain.forward_ms) == 10 and len(plain.step_ms) == 8
    assert all(s >= f for s, f in zip(plain.step_ms, plain.forward_ms[1:]))  # a step holds its forward
    drafter = tiny_drafter(target, "markov", True)
    run = timed_generate(target, [5, 6, 7, 8], 10, drafter=drafter, dspark_verification="fixed")
    assert len(run.forward_ms) == 1 + len(run.stats.rounds)
    hooks = (target._forward_pre_hooks, target._forward_hooks)
    assert all(not h for h in hooks)  # removed afterwards


def test_prompt_floor_takes_a_floor_round_apart():
    """Hand values: two floor rounds (nothing drafted) between drafted ones, against plain steps of 20 and 22 ms."""
    from dspark_hf.bench.analysis import floor_summary, prompt_floor
    from dspark_hf.evaluation.runs import Run

    plain = Run(tokens=[1] * 5, seconds=0.1, forward_ms=[100.0, 19.0, 20.0, 21.0, 19.0], step_ms=[20.0, 22.0, 21.0])
    rounds = [
        RoundStats(drafted=3, scheduled=2, accepted=1, round_ms=40.0, context_ms=30.0, context_tokens=50),  # prompt
        RoundStats(drafted=0, scheduled=0, round_ms=22.0, plan_ms=0.5, bookkeeping_ms=0.25),
        RoundStats(drafted=0, scheduled=0, round_ms=24.0, plan_ms=0.75, bookkeeping_ms=0.25),
        RoundStats(drafted=3, scheduled=1, accepted=0, round_ms=35.0, context_ms=0.6, context_tokens=3),
        RoundStats(drafted=0, scheduled=0),  # the last round: no wall clock recorded, left out
    ]
    run = Run(tokens=[1] * 9, seconds=0.2, stats=GenerationStats(rounds=rounds),
              forward_ms=[120.0, 30.0, 20.0, 22.0, 28.0, 19.0])
    floor = prompt_floor([plain], [run])
    assert floor["floor_rounds"] == 2
    assert floor["round_ms"] == 23.0 and floor["forward_ms"] == 21.0 and floor["plan_ms"] == 0.625
    assert floor["loop_ms"] == pytest.approx((22 - 20 - 0.75 + 24 - 22 - 1.0) / 2)
    assert floor["plain_step_ms"] == 21.0 and floor["plain_forward_ms"] == 19.5 and floor["plain_loop_ms"] == 1.5
    assert floor["ratio"] == pytest.approx(23 / 21)
    assert floor["context_ms_per_token"] == pytest.approx(0.2)  # the prompt's extension left out
    assert floor["prefill_ms"] == 120.0 and floor["prefill_extension_ms"] == 30.0
    rounds_without_floor = GenerationStats(rounds=[rounds[0], rounds[3]])
    assert prompt_floor([plain], [Run([1], 0.1, rounds_without_floor, forward_ms=[1.0, 2.0, 3.0])]) is None
    misaligned = Run([1], 0.1, run.stats, forward_ms=[1.0, 2.0])  # forwards do not line up: left out
    assert prompt_floor([plain], [misaligned]) is None
    # the floor pass pools repeated runs: rounds of both runs, steps of both plain runs, prefills' median
    again = Run(tokens=[1] * 9, seconds=0.2, stats=GenerationStats(rounds=[
        RoundStats(drafted=0, scheduled=0, round_ms=30.0, plan_ms=1.0, bookkeeping_ms=0.5),
        RoundStats(drafted=0, scheduled=0)]), forward_ms=[140.0, 27.0, 18.0])
    plain2 = Run(tokens=[1] * 3, seconds=0.1, forward_ms=[90.0, 23.0, 25.0], step_ms=[24.0])
    pooled = prompt_floor([plain, plain2], [run, misaligned, again])
    assert pooled["floor_rounds"] == 3 and pooled["round_ms"] == 24.0 and pooled["forward_ms"] == 22.0
    assert pooled["plain_step_ms"] == 21.5 and pooled["plain_forward_ms"] == 20.5  # steps 20 21 22 24; 19 19 20 21 23 25
    assert pooled["ratio"] == pytest.approx(24 / 21.5) and pooled["prefill_ms"] == 130.0
    assert pooled["prefill_extension_ms"] == 30.0  # only the first run drafted
    summary = floor_summary({"p": floor, "q": None, "r": {**floor, "ratio": 1.5, "floor_rounds": 1}})
    assert summary["prompts"] == 2 and summary["floor_rounds"] == 3 and summary["worst_ratio"] == 1.5
    assert summary["worst_prompt"] == "r" and summary["per_prompt"] == {"p": pytest.approx(23 / 21), "r": 1.5}
    assert floor_summary({"p": None}) is None


def test_low_acceptance_suite_is_held_out_chat():
    """The low-acceptance set (issue #28): at least 10 held-out chat prompts, in the order they were ranked."""
    from dspark_hf.sources.sharegpt import split_of

    texts = suites_mod.suite_texts(["low-accept", "chat"])
    low = texts["low-accept"]
    assert [i for i, _ in low] == list(suites_mod.LOW_ACCEPTANCE_IDS) and len(low) >= 10
    chat = dict(texts["chat"])
    for record_id, prompt in low:
        assert split_of(record_id) == "test" and chat[record_id] == prompt  # never trained on, not a math problem


# ------------------------------------------------------------------------------------- smoke run
V, D = 96, 64


def tiny_drafter(target, head, confidence):
    torch.manual_seed({"markov": 1, "rnn": 2, "none": 3}[head])
    config = DSparkConfig.for_target(target, target_layer_ids=[0, 1], num_hidden_layers=1, sequential_head=head,
                                     sequential_rank=16, block_size=3, confidence_head=confidence, mask_token_id=0)
    drafter = DSparkDrafter(config).bind(target).eval()
    if confidence:
        drafter.calibration = SequentialTemperatureScaling(temperatures=[0.9, 1.1, 1.0])
    return drafter


def test_threshold_mode_is_timed_only_for_a_positive_best_threshold():
    settings = bench.BenchSettings()
    methods = bench.threshold_methods({"a": 0.0, "b": None, "c": 0.3}, settings)  # t = 0 is the fixed mode
    assert [(m.name, m.kwargs["dspark_threshold"]) for m in methods] == [("c:threshold", 0.3)]
    pass2 = [bench.Method("plain"), bench.Method("c:fixed", "c"), bench.Method("c:async", "c")]
    wall = {"s": {"plain": 1, "c:fixed": 2, "c:async": 3}}
    ordered, merged = bench.merge_threshold_methods(pass2, methods, wall, {"s": {"plain": 9, "c:threshold": 4}})
    assert [m.name for m in ordered] == ["plain", "c:fixed", "c:threshold", "c:async"]
    assert merged == {"s": {"plain": 1, "c:fixed": 2, "c:threshold": 4, "c:async": 3}}  # pass 2's plain is kept


@pytest.mark.parametrize("argv, expected", [
    ([], (4, 96, False)),  # the full run
    (["--limit", "3"], (3, bench_cli.QUICK_MAX_NEW_TOKENS, True)),  # a quick run
    (["--limit", "3", "--max-new-tokens", "96"], (3, 96, False)),
    (["--max-new-tokens", "64"], (4, 64, False)),
])
def test_quick_run_settings(argv, expected):
    settings, notes = bench_cli.settings_from_args(_bench_args(argv))
    assert (settings.limit, settings.max_new_tokens, bool(notes)) == expected


def _bench_args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


@pytest.mark.parametrize("argv, flag", [(["--limit", "0"], "--limit"), (["--max-new-tokens", "1"], "--max-new-tokens"),
                                        (["--gamma", "0"], "--gamma"), (["--repeats", "0"], "--repeats")])
def test_bad_settings_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=f"\\({flag}\\) must be >= "):
        bench_cli.settings_from_args(_bench_args(argv))


def test_median_run_takes_the_middle_run_and_the_faster_of_two():
    runs = [Run(tokens=[1], seconds=s) for s in (3.0, 1.0, 2.0, 4.0)]
    assert wall_clock.median_run(runs[:3]).seconds == 2.0
    assert wall_clock.median_run(runs[:2]).seconds == 1.0  # the faster of the middle two
    assert wall_clock.median_run(runs).seconds == 2.0
    with pytest.raises(ValueError, match="at least one run"):
        wall_clock.median_run([])


class _ScriptedMethod(bench.Method):
    """A method whose n-th run returns its n-th scripted ``(tokens, seconds)``, for the repeated wall-clock pass."""

    def __init__(self, name, script, order):
        super().__init__(name)
        self.script, self.calls, self.order = script, 0, order

    def run(self, target, ids, max_new_tokens, drafters, seed=0):
        tokens, seconds = self.script[self.calls]
        self.calls += 1
        self.order.append(self.name)
        return Run(tokens=tokens, seconds=seconds)


def test_repeated_wall_clock_pass_reports_median_runs_and_checks_every_run():
    # plain: 2, 1, 3 s -> median 2 s; m: 1, 0.5, 2 s -> median 1 s, so the prompt's speedup is 2.0; m's third run
    # differs from plain at new token 2 although its median run does not
    order = []
    plain = _ScriptedMethod("plain", [([1, 2, 3], 2.0), ([1, 2, 3], 1.0), ([1, 2, 3], 3.0)], order)
    m = _ScriptedMethod("m", [([1, 2, 3], 1.0), ([1, 2, 3], 0.5), ([1, 2, 4], 2.0)], order)
    settings = bench.BenchSettings(repeats=3, warmup_tokens=0)
    records = wall_clock.wall_clock_pass(None, {}, [plain, m], {"s": [("p0", [7, 8])]}, settings, log=lambda *a: None)
    assert order == ["plain", "m", "m", "plain", "plain", "m"]  # the order rotated by one each repeat
    assert [r.seconds for r in records["s"][0]["repeats"]["m"]] == [1.0, 0.5, 2.0]
    summary, mismatches = wall_clock.summarize_wall_clock(records, [plain, m], log=lambda *a: None)
    row = summary["s"]["m"]["per_prompt"][0]
    assert row["seconds"] == 1.0 and row["speedup"] == pytest.approx(2.0)
    assert row["speedup_runs"] == pytest.approx([2.0, 2.0, 1.5])  # each run against plain's run of the same repeat
    assert not row["identical"] and summary["s"]["m"]["mismatches"] == 1
    assert mismatches == [{"suite": "s", "prompt": "p0", "method": "m", "position": 2, "tokens": 3, "plain_tokens": 3}]


def test_lockstep_wall_clock_pass_takes_each_prompts_speedup_from_its_pairs():
    """--lockstep: each run of m beside a plain run of its own, the first turn alternating; m's speedup on the prompt is
    the median of its pairs' ratios (2/1, 3/2, 1/2 -> 1.5), not its median run over plain's (1 s vs 2 s -> 2.0)."""
    order = []
    plain = _ScriptedMethod("plain", [([1, 2, 3], 2.0), ([1, 2, 3], 3.0), ([1, 2, 3], 1.0)], order)
    m = _ScriptedMethod("m", [([1, 2, 3], 1.0), ([1, 2, 3], 2.0), ([1, 2, 3], 2.0)], order)
    settings = bench.BenchSettings(repeats=3, warmup_tokens=0, lockstep=True)
    records = wall_clock.wall_clock_pass(torch.nn.Identity(), {}, [plain, m], {"s": [("p0", [7, 8])]}, settings,
                                         log=lambda *a: None)
    assert order == ["plain", "m", "m", "plain", "plain", "m"]  # scripted runs run no forward: first turn first
    assert [r.seconds for r in records["s"][0]["partners"]["m"]] == [2.0, 3.0, 1.0]
    summary, mismatches = wall_clock.summarize_wall_clock(records, [plain, m], log=lambda *a: None)
    row = summary["s"]["m"]["per_prompt"][0]
    assert row["speedup_runs"] == pytest.approx([2.0, 1.5, 0.5]) and row["speedup"] == pytest.approx(1.5)
    assert summary["s"]["m"]["min_speedup"] == pytest.approx(1.5) and summary["s"]["plain"]["min_speedup"] == 1.0
    assert row["seconds"] == 2.0 and not mismatches  # the median run (of an even middle pair, the faster)
    with pytest.raises(ValueError, match="pairs every method with plain"):
        wall_clock.wall_clock_pass(torch.nn.Identity(), {}, [m, plain], {"s": [("p0", [7, 8])]}, settings)


def test_lockstep_wall_clock_pass_on_a_model_matches_plain_generate():
    """A tiny target and drafter in lockstep: every run's output is plain greedy's, each run counts its own forwards,
    and the prompt's speedup is the median of its two pairs' ratios."""
    target = tiny_llama(V, D, 2, intermediate_size=96, head_dim=16, max_position_embeddings=512)
    drafters = {"dspark": tiny_drafter(target, "markov", True)}
    methods = [bench.Method("plain"), bench.Method("dspark:fixed", "dspark", {"dspark_verification": "fixed",
                                                                             "dspark_block_size": 3,
                                                                             "dspark_lookup": False})]
    settings = bench.BenchSettings(gamma=3, max_new_tokens=10, repeats=2, warmup_tokens=0, lockstep=True)
    records = wall_clock.wall_clock_pass(target, drafters, methods, {"s": [("p0", [5, 6, 7, 8])]}, settings,
                                         log=lambda *a: None)
    record = records["s"][0]
    alone = bench.Method("plain").run(target, [5, 6, 7, 8], 10, drafters).tokens
    assert [r.tokens for r in record["repeats"]["plain"] + record["repeats"]["dspark:fixed"]] == [alone] * 4
    assert all(len(r.forward_ms) == 10 for r in record["repeats"]["plain"])
    assert all(len(r.forward_ms) == 1 + len(r.stats.rounds) for r in record["repeats"]["dspark:fixed"])
    summary, mismatches = wall_clock.summarize_wall_clock(records, methods, log=lambda *a: None)
    row = summary["s"]["dspark:fixed"]["per_prompt"][0]
    assert not mismatches and row["speedup"] == pytest.approx(sum(row["speedup_runs"]) / 2)


def test_lockstep_floor_pass_compares_each_floor_run_with_its_own_plain_partner(monkeypatch):
    """--lockstep, pass 4: every floor run in lockstep with a plain run of its own (``lockstep_runs``), its rounds
    lined up with its own forwards, and each arm's floor taken against its own partners' steps, not every plain run;
    the outputs still match plain greedy."""
    from dspark_hf.bench import floor, methods
    from dspark_hf.bench.analysis import prompt_floor

    target = tiny_llama(V, D, 2, intermediate_size=96, head_dim=16, max_position_embeddings=512)
    drafters = {"dspark": tiny_drafter(target, "markov", True), "dspark-rnn": tiny_drafter(target, "rnn", True)}
    settings = bench.BenchSettings(gamma=3, max_new_tokens=10, floor_repeats=2, warmup_tokens=0, lockstep=True)
    plan = bench.plan_methods(drafters, {}, settings)
    for arm in methods.floor_methods(plan):  # warm-up, as the runner's pass 2 is: lazy SPS profiling runs forwards
        arm.run(target, [5, 6, 7, 8], 3, drafters)
    paired, compared = [], []

    def lockstep_spy(*args):
        paired.append(methods.lockstep_runs(*args))
        return paired[-1]

    def prompt_floor_spy(plains, runs):
        compared.append((plains, runs))
        return prompt_floor(plains, runs)

    monkeypatch.setattr(floor, "lockstep_runs", lockstep_spy)
    monkeypatch.setattr(floor, "prompt_floor", prompt_floor_spy)
    costs, mismatches = floor.floor_pass(target, drafters, plan, {"s": [("p0", [5, 6, 7, 8])]}, settings, log=lambda *a: None)
    arms = ["dspark:scheduler+lookup", "dspark-rnn:scheduler+lookup"]
    assert list(costs) == arms and not mismatches
    [(runs, partners, _)] = paired  # one prompt: one call, 2 repeats x 2 arms = 4 pairs
    assert len(runs["plain"]) == 4 and [len(partners[a]) for a in arms] == [2, 2]
    assert len({id(p) for a in arms for p in partners[a]}) == 4  # a plain partner of its own for every floor run
    for arm, (plains, floor_runs) in zip(arms, compared, strict=True):
        assert [id(r) for r in floor_runs] == [id(r) for r in runs[arm]]
        assert [id(p) for p in plains] == [id(p) for p in partners[arm]]  # its partners only
        assert all(len(r.forward_ms) == 1 + len(r.stats.rounds) == 10 for r in floor_runs)
        assert costs[arm]["s"]["floor_rounds"] == 2 * (10 - 2)  # every round but each run's last is a floor round
        assert costs[arm]["s"]["ratio"] == pytest.approx(prompt_floor(partners[arm], runs[arm])["ratio"])


def test_pooled_tau_weights_prompts_by_rounds():
    rows = [{"tau": 2.0, "rounds": 10}, {"tau": 1.0, "rounds": 30}, {"tau": None, "rounds": None}]
    assert wall_clock.pooled_tau(rows) == pytest.approx((20 + 30) / 40)  # not the mean of per-prompt τ, 1.5
    assert wall_clock.pooled_tau(rows[2:]) is None


def test_runner_end_to_end(tmp_path):
    target = tiny_llama(V, D, 2, intermediate_size=96, head_dim=16, max_position_embeddings=512)
    drafters = {
        "dspark": tiny_drafter(target, "markov", True),
        "dspark-rnn": tiny_drafter(target, "rnn", True),
        "dflash": tiny_drafter(target, "none", False),
    }
    g = torch.Generator().manual_seed(5)
    suites = {
        "a": [("a0", torch.randint(1, V, (6,), generator=g).tolist()), ("a1", torch.randint(1, V, (9,), generator=g).tolist())],
        "b": [("b0", [5] * 8)],  # repetitive, and the target repeats itself (9 9 9 9 9 76 3 3 3 76 ...): lookup hits
    }
    settings = bench.BenchSettings(gamma=3, max_new_tokens=12, limit=2, warmup_tokens=3)
    sps = tiny_sps_curve(CPU_MS[:8])  # the CPU-like cost of verify steps of 1..8 tokens
    result, raw = bench.run_bench(target, drafters, suites, settings, sps=sps, command="pytest", log=lambda *a: None)

    assert isinstance(result, BenchResult) and result.machine.command == "pytest"
    keys = list(result.to_json())
    assert keys[:16] == ["schema_version", "machine", "settings", "suites", "drafters",
                         "tau_ratio_dspark_over_dflash", "tau_ratios", "tau", "conditional_acceptance",
                         "confidence", "wall_clock", "builtin_dflash", "sps", "round_cost", "notes",
                         "runtime_s"]  # benchmarks.json's keys; "plots" once written
    assert keys[16:] in (["floor_pass"], ["floor_cost", "floor_pass"])  # in-run floor rounds when there were any
    for per_suite in (result.floor_cost or {}).values():
        for floor in per_suite.values():
            assert floor.round_ms == pytest.approx(floor.forward_ms + floor.plan_ms + floor.bookkeeping_ms
                                                   + floor.loop_ms, rel=0.5)  # medians of sums, roughly
    # pass 4, the floor: each default (the +lookup hybrids) with drafting off, every token after the prefill's a floor
    # round (the last of each run left out), pooled over 2 runs of every prompt
    assert set(result.floor_pass) == {"dspark:scheduler+lookup", "dspark-rnn:scheduler+lookup"}
    for per_suite in result.floor_pass.values():
        assert set(per_suite) == {"a", "b"}
        assert per_suite["a"].prompts == 2 and per_suite["a"].floor_rounds == 2 * 2 * (12 - 2)
        assert per_suite["b"].worst_prompt == "b0" and per_suite["b"].per_prompt == {"b0": per_suite["b"].ratio}
        assert per_suite["b"].prefill_extension_ms is None  # the drafter never ran
    assert result.settings.floor_repeats == 2
    assert list(result.sps.ms_per_step_by_context) == [str(c) for c in sps.rows]
    assert result.sps.ms_per_step_by_context[str(sps.context_len)] == pytest.approx(result.sps.ms_per_step)
    assert result.settings.gamma == 3 and result.settings.math_filter.max_chars > 0
    taus = result.tau["greedy"]["dspark"]
    assert taus["macro"] == pytest.approx((taus["a"] + taus["b"]) / 2)
    assert result.tau_ratio_dspark_over_dflash == pytest.approx(taus["macro"] / result.tau["greedy"]["dflash"]["macro"])
    assert set(result.tau_ratios) == {"greedy", "t1"}
    assert len(result.conditional_acceptance["t1"]["a"]["dflash"]) == 3
    assert set(result.confidence) == {"dspark", "dspark-rnn"}  # the parallel drafter has no confidence head
    assert len(result.confidence["dspark"].suites["all"].threshold_sweep) == 10
    wall = result.wall_clock
    assert wall.methods[:3] == ["plain", "prompt-lookup", "dflash:builtin-dflash"]
    assert {"dspark:fixed", "dspark:scheduler", "dspark:async", "dspark-rnn:async", "dflash:fixed"} <= set(wall.methods)
    # the hybrid with prompt lookup, for drafters with calibrated confidences (config mode "scheduler")
    assert {m for m in wall.methods if m.endswith("+lookup")} == {"dspark:scheduler+lookup",
                                                                  "dspark-rnn:scheduler+lookup"}
    hybrid = wall.suites["b"]["dspark:scheduler+lookup"]
    n_tokens = sum(r.new_tokens for r in hybrid.per_prompt)
    assert hybrid.token_sources["target"] == sum(r.rounds for r in hybrid.per_prompt)
    assert sum(hybrid.token_sources.values()) == n_tokens - len(hybrid.per_prompt)  # all but the prefill's
    assert hybrid.token_sources["lookup"] > 0  # lookup drafts were accepted
    assert wall.suites["b"]["dspark:scheduler"].token_sources["lookup"] == 0
    assert wall.suites["b"]["plain"].token_sources is None
    best = result.confidence["dspark"].best_threshold
    assert best, "this smoke run must cover pass 3 (the threshold mode at t > 0)"
    assert wall.methods.index("dspark:threshold") == wall.methods.index("dspark:fixed") + 1
    assert list(wall.suites["a"]) == wall.methods
    # greedy τ comes from pass 2's timed fixed runs, which the wall-clock table reports too, pooled the same way
    for suite in suites:
        assert wall.suites[suite]["dspark:fixed"].tau == pytest.approx(taus[suite])
    fixed_rounds = [r.rounds for p in ("a", "b") for r in wall.suites[p]["dspark:fixed"].per_prompt]
    assert sum(len(st.rounds) for st in sum(raw["stats"]["greedy"]["dspark"].values(), [])) == sum(fixed_rounds)
    assert wall.mismatches_total == 0, wall.mismatches  # greedy speculative output == plain generate
    assert result.builtin_dflash.status == "adapted"
    # full draft vocabulary: the built-in path drafts what the drafter's own fixed path drafts
    # (the built-in path counts drafted blocks; DSpark's stats also count a last verification without a draft)
    for suite in suites:
        builtin = wall.suites[suite]["dflash:builtin-dflash"].per_prompt
        own = raw["stats"]["greedy"]["dflash"][suite]  # the dflash:fixed runs' statistics, prompt by prompt
        assert [r.rounds for r in builtin] == [sum(r.drafted > 0 for r in st.rounds) for st in own]
    assert result.round_cost["dspark:fixed"].median_draft_ms > 0
    for suite in suites:  # the worst prompt of every method (issue #28)
        for summary in wall.suites[suite].values():
            assert summary.min_speedup == min(r.speedup for r in summary.per_prompt)

    path = report.write_report(result, raw, tmp_path, drafters)
    loaded = json.loads(path.read_text())
    assert loaded["wall_clock"]["mismatches_total"] == 0 and loaded["plots"] == result.plots
    assert BenchResult.load(path) == result and BenchResult.load(path).dumps() == path.read_text()
    assert (tmp_path / "benchmarks.md").read_text() == report.markdown_report(loaded) + "\n"
    markdown = (tmp_path / "benchmarks.md").read_text()
    assert markdown.startswith("# dspark bench") and "min per-prompt speedup" in markdown
    assert "**Every prompt** (all suites)" in markdown
    assert "**The floor** (pass 4)" in markdown and "| dspark:scheduler+lookup · b | 1 | 20 |" in markdown
    # issue 26: the threshold row's speedup is against pass 3's own plain run, whose tok/s the table now states
    threshold = wall.suites["a"]["dspark:threshold"]
    own_plain = threshold.median_tokens_per_s / threshold.speedup_of_medians
    assert f"interleaved with a plain run of its own (median {own_plain:.1f} tok/s)" in report.markdown_report(loaded)
    for name in ("conditional_acceptance_a.png", "conditional_acceptance_b.png", "threshold_sweep_dspark.png",
                 "sps_curve.png", "wall_clock_speedup.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in result.tau["t1"]["dflash"].values())
