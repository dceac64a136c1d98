"""The concurrency bench's paired protocol (issue 24): its order and its ratios on hand values, no model run."""

import pytest

from dspark_hf.bench import concurrency
from dspark_hf.bench.concurrency import PLAIN, adjacent_ratios, check_arms, markdown, run_concurrency, schedule

S, A = ("scheduler", 7), ("async", 7)


def scripted_arm(loops):
    """A stand-in for :func:`concurrency.run_arm` that records ``(R, prompts)`` of each closed loop in ``loops`` and
    reports 1 tok/s, each request generating ``[5]``."""
    def run_arm(target, drafter, prompts, concurrency, max_new_tokens, mode, k, warm_up_tokens):
        loops.append((concurrency, prompts))
        row = {"arm": mode, "concurrency": concurrency, "requests": len(prompts), "aggregate_tok_s": 1.0,
               "per_user_tok_s_median": 1.0, "per_user_tok_s_p10": 1.0, "tau": 1.0, "verified_per_request": 1.0,
               "rejected_drafts": 0, "drafting_steps": 0, "steps": 1, "step_ms_median": 1.0,
               "predicted_step_error_median": None}
        return row, [[5]] * len(prompts)

    return run_arm


def test_paired_schedule_puts_plain_around_every_run_and_rotates_the_others():
    assert schedule([PLAIN, S, A], 3, paired=True) == [
        (0, PLAIN), (0, S), (0, PLAIN), (0, A),
        (1, PLAIN), (1, A), (1, PLAIN), (1, S),
        (2, PLAIN), (2, S), (2, PLAIN), (2, A), (2, PLAIN)]
    # the default order: every loop once per repetition, every other repetition reversed
    assert schedule([PLAIN, S, A], 2) == [(0, PLAIN), (0, S), (0, A), (1, A), (1, S), (1, PLAIN)]


def test_adjacent_ratios_divide_by_the_mean_of_the_plain_runs_before_and_after():
    timeline = [(PLAIN, 10.0), (S, 11.0), (PLAIN, 12.0), (A, 9.0), (PLAIN, 8.0), (S, 6.0)]
    assert adjacent_ratios(timeline) == {S: [pytest.approx(1.0), pytest.approx(0.75)],  # 11 / 11; 6 / 8 (an end)
                                         A: [pytest.approx(0.9)]}  # 9 / 10
    # the nearest plain runs, not the next runs: two arms between two plains share them
    assert adjacent_ratios([(PLAIN, 4.0), (S, 5.0), (A, 3.0), (PLAIN, 6.0)]) == {S: [1.0], A: [0.6]}
    assert adjacent_ratios([(S, 5.0)]) == {}  # no plain run: no ratio


def test_check_arms_refuses_unknown_arms_and_a_paired_run_without_plain_or_another_arm():
    check_arms(("plain", "scheduler"), paired=True)
    check_arms(("scheduler",))  # without paired, plain may be left out
    with pytest.raises(ValueError, match="unknown arms"):
        check_arms(("plain", "sched"))
    for arms in (("scheduler", "async"), ("plain",)):
        with pytest.raises(ValueError, match="needs plain and another arm"):
            check_arms(arms, paired=True)


def test_paired_run_reports_the_median_adjacent_ratio_and_its_range(monkeypatch):
    """Scripted tok/s per run (in the order the paired schedule runs them): the rows' paired medians and ranges."""
    speeds = iter([10.0, 9.0, 10.0, 11.0, 12.0, 12.0, 12.0, 12.0, 8.0, 10.0, 8.0, 9.0, 8.0])  # P S P A P A P S P S P A P
    # S: 9/10, 12/10, 10/8 -> median 1.2 (0.9-1.25); A: 11/11, 12/12, 9/8 -> median 1.0 (1.0-1.125)

    warm_ups = []

    def scripted(target, drafter, prompts, concurrency, max_new_tokens, mode, k, warm_up_tokens):
        warm_ups.append(warm_up_tokens)
        tok_s = next(speeds)
        row = {"arm": mode, "concurrency": concurrency, "requests": len(prompts), "aggregate_tok_s": tok_s,
               "per_user_tok_s_median": tok_s / 2, "per_user_tok_s_p10": tok_s / 4, "tau": 1.0,
               "verified_per_request": 1.0, "rejected_drafts": 0, "drafting_steps": 0, "steps": 1, "step_ms_median": 1.0,
               "predicted_step_error_median": None}
        return row, [[1, 2]] * len(prompts)

    monkeypatch.setattr(concurrency, "run_arm", scripted)
    lines = []
    result = run_concurrency(None, None, [[1]], [1], 2, 7, arms=("plain", "scheduler", "async"), log=lines.append,
                             repeats=3, paired=True)
    assert [line.split(": ")[0] for line in lines if " run " in line][:4] == [
        "R=1 run 1/3 plain", "R=1 run 1/3 scheduler", "R=1 run 1/3 plain", "R=1 run 1/3 async"]
    assert warm_ups == [2, 2, 4, 2] + [4] * 9  # each loop's first run warms up to full length (the gate learns R)
    plain, scheduler, async_ = result["rows"]
    assert plain["paired_median"] is None and len(plain["tok_s_runs"]) == 7
    assert scheduler["speed_vs_plain_paired"] == pytest.approx([0.9, 1.2, 1.25])
    assert (scheduler["paired_median"], scheduler["paired_range"]) == (pytest.approx(1.2), pytest.approx([0.9, 1.25]))
    assert (async_["paired_median"], async_["paired_range"]) == (pytest.approx(1.0), pytest.approx([1.0, 1.125]))
    assert scheduler["paired_median_per_user"] == pytest.approx(1.2)  # per-user tok/s are half: the same ratios
    assert scheduler["speed_vs_plain"] == pytest.approx(12 / 12)  # fastest over plain's fastest, as before
    assert result["settings"]["protocol"] == "paired"
    table = markdown(result)
    assert "| 1 | scheduler | 12.0 | 6.0 / 3.0 | 1.00 (0.90 / 1.20 / 1.25) | 1.200 (0.900-1.250); 1.200 |" in table
    assert "plain ran 7 times" in table and "in the paired order below" in table and "run i over" not in table
    assert "every arm ran 3 times per R" in table and "median over the 3 runs" in table


def test_lockstep_run_reports_each_arms_median_ratio_to_its_plain_partner(monkeypatch):
    """Scripted lockstep pairs (plain tok/s, arm tok/s) in the order the paired schedule runs the arms: the rows'
    ratios, the warm-ups (each loop's first at R to full length), the first turn alternating plain / arm."""
    pairs = iter([(10.0, 9.0), (10.0, 11.0), (12.0, 12.0), (8.0, 12.0), (8.0, 10.0), (10.0, 9.0)])  # S A A S S A
    # S: 9/10, 12/8, 10/8 -> median 1.25 (0.9-1.5); A: 11/10, 12/12, 9/10 -> median 1.0 (0.9-1.1)
    calls = []

    def row(mode, tok_s):
        return {"arm": mode, "concurrency": 1, "requests": 2, "aggregate_tok_s": tok_s, "per_user_tok_s_median": tok_s / 2,
                "per_user_tok_s_p10": tok_s / 4, "tau": 1.0, "verified_per_request": 1.0, "rejected_drafts": 0,
                "drafting_steps": 0, "steps": 1, "step_ms_median": 1.0, "predicted_step_error_median": None}

    def scripted(target, drafter, prompts, concurrency, max_new_tokens, loop, plain_warm_up, warm_up_tokens, first):
        calls.append((loop[0], plain_warm_up, warm_up_tokens, first))
        plain, arm = next(pairs)
        return (row("plain", plain), [[1, 2]] * len(prompts)), (row(loop[0], arm), [[1, 2]] * len(prompts))

    monkeypatch.setattr(concurrency, "lockstep_pair", scripted)
    lines = []
    result = run_concurrency(None, None, [[1]], [1], 2, 7, arms=("plain", "scheduler", "async"), log=lines.append,
                             repeats=3, lockstep=True)
    assert calls == [("scheduler", 2, 2, 0), ("async", 4, 2, 1), ("async", 4, 4, 0), ("scheduler", 4, 4, 1),
                     ("scheduler", 4, 4, 0), ("async", 4, 4, 1)]
    plain, scheduler, async_ = result["rows"]
    assert plain["paired_median"] is None and len(plain["tok_s_runs"]) == 6  # plain ran once per pair
    assert scheduler["drafting_steps_runs"] == [0, 0, 0]
    assert scheduler["speed_vs_plain_paired"] == pytest.approx([0.9, 1.5, 1.25])
    assert (scheduler["paired_median"], scheduler["paired_range"]) == (pytest.approx(1.25), pytest.approx([0.9, 1.5]))
    assert (async_["paired_median"], async_["paired_range"]) == (pytest.approx(1.0), pytest.approx([0.9, 1.1]))
    assert scheduler["paired_median_per_user"] == pytest.approx(1.25)
    assert result["settings"]["protocol"] == "lockstep"
    assert lines[0] == result["notes"][0]  # one prompt for 2 requests: the note comes first
    assert lines[1] == "R=1 run 1/3 scheduler: 9.0 tok/s, 0/1 drafting steps; in lockstep with plain 10.0 tok/s, × 0.900"
    table = markdown(result)
    assert "× plain in lockstep: median (range); per user |" in table
    assert "| 1 | scheduler | 12.0 | 6.0 / 3.0 | 1.00 (0.90 / 1.50 / 1.25) | 1.250 (0.900-1.500); 1.250 |" in table
    assert "(6 plain runs)" in table and "each in lockstep with plain" in table
    with pytest.raises(ValueError, match="not both"):
        run_concurrency(None, None, [[1]], [1], 2, 7, arms=("plain", "scheduler"), paired=True, lockstep=True)
    with pytest.raises(ValueError, match="needs plain and another arm"):
        run_concurrency(None, None, [[1]], [1], 2, 7, arms=("scheduler",), lockstep=True)


@pytest.mark.parametrize(("protocol", "counts"), [
    ("interleaved", ["every arm ran 1 time per R"]),
    ("paired", ["every arm ran 1 time per R", "so plain ran 2 times", "median over the 1 run and"]),  # P S P
    ("lockstep", ["every arm ran 1 time per R", "(1 plain run)", "median over the 1 run and"]),
])
def test_the_legend_counts_runs_in_the_right_number(protocol, counts):
    result = {"rows": [], "settings": {"repeats": 1, "arms": ["plain", "scheduler"], "gamma": 7, "fixed_ks": [1, 2],
                                       "protocol": protocol}}
    table = markdown(result)
    for text in counts:
        assert text in table
    assert "1 times" not in table and "1 runs" not in table


def test_fewer_prompts_than_requests_repeat_in_turn_with_a_note(monkeypatch):
    """3 distinct prompts: R = 1 serves 2 of them, R = 2 and R = 3 need 4 and 6 requests, so the prompts repeat in
    turn; the note says so and names --limit, and the settings record the 3."""
    batches = []
    monkeypatch.setattr(concurrency, "run_arm", scripted_arm(batches))
    lines = []
    result = run_concurrency(None, None, [[1], [2], [3]], [1, 2, 3], 2, 7, arms=("plain",), log=lines.append,
                             repeats=1)
    assert batches == [(1, [[1], [2]]), (2, [[1], [2], [3], [1]]), (3, [[1], [2], [3], [1], [2], [3]])]
    note = ("R = 2, 3: the closed loop serves 2·R requests from 3 distinct prompts, taken in turn and repeated; a "
            "larger --limit (prompts per suite) gives more distinct ones (6 for R = 3).")
    assert result["notes"] == [note] and lines[0] == note
    assert result["settings"]["distinct_prompts"] == 3
    enough = run_concurrency(None, None, [[1], [2], [3], [3]], [1], 2, 7, arms=("plain",), log=lines.append, repeats=1)
    assert enough["notes"] == [] and enough["settings"]["distinct_prompts"] == 3  # a repeated prompt counts once


@pytest.mark.parametrize(("arms", "shown"), [(["plain", "scheduler"], False), (["plain", "best_fixed"], True)])
def test_the_best_fixed_sentence_appears_only_when_that_arm_ran(arms, shown):
    result = {"rows": [], "settings": {"repeats": 2, "arms": arms, "gamma": 7, "fixed_ks": [1, 3]}}
    sentence = " `best_fixed` is the fastest fixed k of 1, 3 at this R (an oracle: each R picks its own k)."
    assert (sentence in markdown(result)) is shown
