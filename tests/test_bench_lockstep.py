"""Lockstep timing (``dspark_hf.bench.lockstep``, issues 24 and 28): outputs as when run alone, the baton's order,
each arm's time its own, failures raised. No wall-clock thresholds: times come from a scripted clock."""

import threading
import time

import pytest
import torch
from conftest import cycle_target, scheduled_cycle_drafter

import dspark_hf  # noqa: F401  (routes DSpark drafters through DSparkCandidateGenerator)
from dspark_hf.bench import lockstep
from dspark_hf.bench.lockstep import run_lockstep
from dspark_hf.evaluation.runs import timed_generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return cycle_target(num_hidden_layers=2, alpha=0.026)


class ScriptedClock:
    """Seconds that move only when an arm says so (:meth:`advance`), never with the real time."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def forwards(target, n: int, clock: ScriptedClock | None = None, seconds: float = 0.0):
    """An arm: ``n`` one-token forwards of ``target``, ``seconds`` on ``clock`` before each and after the last;
    returns its own elapsed ``time.perf_counter`` (what a run timing itself would see)."""
    def arm():
        start = time.perf_counter()
        for _ in range(n):
            if clock is not None:
                clock.advance(seconds)
            target(torch.tensor([[1]]))
        if clock is not None:
            clock.advance(seconds)
        return time.perf_counter() - start
    return arm


def test_lockstep_runs_are_the_runs_alone(target):
    """Plain generate and DSpark generate in lockstep: the same tokens as each alone, and each run's forward clock
    sees its own forwards only (the prefill, then one per step / round)."""
    drafter = scheduled_cycle_drafter(target)
    prompt = [5, 9, 13, 2, 7]
    plain_alone = timed_generate(target, prompt, 24)
    dspark_alone = timed_generate(target, prompt, 24, drafter=drafter, dspark_verification="fixed")
    result = run_lockstep(target, [lambda: timed_generate(target, prompt, 24),
                                   lambda: timed_generate(target, prompt, 24, drafter=drafter,
                                                          dspark_verification="fixed")])
    plain, dspark = result.values
    assert plain.tokens == plain_alone.tokens and dspark.tokens == dspark_alone.tokens == plain_alone.tokens
    assert [s.scheduled for s in dspark.stats.rounds] == [s.scheduled for s in dspark_alone.stats.rounds]
    assert len(plain.forward_ms) == 24 and len(dspark.forward_ms) == 1 + len(dspark.stats.rounds) < 24
    assert result.forwards == [24, len(dspark.forward_ms)]
    assert not target._forward_pre_hooks and not target._forward_hooks  # removed afterwards


@pytest.mark.parametrize("first, order", [(0, [0, 1, 0, 1, 0, 1, 1, 1]), (1, [1, 0, 1, 0, 1, 0, 1, 1])])
def test_the_baton_alternates_from_the_first_arm_and_a_finished_arm_drops_out(target, first, order):
    result = run_lockstep(target, [forwards(target, 3), forwards(target, 5)], first=first)
    assert result.order == order and result.forwards == [3, 5]


def test_three_arms_take_turns_in_cyclic_order(target):
    result = run_lockstep(target, [forwards(target, 2), forwards(target, 1), forwards(target, 3)], first=2)
    assert result.order == [2, 0, 1, 2, 0, 2]


def test_each_arm_is_timed_on_its_own_turns_only(target):
    """Arm 0 spends 1 s before each of its 3 forwards and after the last, arm 1 10 s (4 forwards): on the lockstep's
    clock arm 0 held the baton 4 s and arm 1 50 s, and each arm's own ``time.perf_counter`` says the same, although
    the scripted clock moved 54 s while they ran."""
    clock = ScriptedClock()
    result = run_lockstep(target, [forwards(target, 3, clock, 1.0), forwards(target, 4, clock, 10.0)], clock=clock)
    assert result.seconds == [4.0, 50.0]
    assert result.values == [4.0, 50.0]  # the arms' own clocks skip the other arm's turns
    assert clock.now == 154.0 and time.perf_counter is lockstep._REAL_CLOCK  # the real clock is back


def test_arms_run_in_the_callers_thread_at_its_torch_thread_count(target):
    """One OS thread, so one OpenMP team (a worker thread's own team made every forward ~1.5x slower at 2 threads)."""
    def arm():
        target(torch.tensor([[1]]))
        return threading.get_ident(), torch.get_num_threads(), torch.is_inference_mode_enabled()

    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            values = run_lockstep(target, [arm, arm]).values
            assert values == [(threading.get_ident(), threads, True)] * 2
    finally:
        torch.set_num_threads(before)
    assert not torch.is_inference_mode_enabled()  # only inside the lockstep


def test_a_failing_arm_raises_and_stops_the_others(target):
    count, unwound = [], []

    def fails():
        target(torch.tensor([[1]]))
        target(torch.tensor([[1]]))
        raise KeyError("arm 1 failed")

    def long_arm():
        try:
            for _ in range(100):
                target(torch.tensor([[1]]))
                count.append(1)
        finally:
            unwound.append(True)

    with pytest.raises(KeyError, match="arm 1 failed"):
        run_lockstep(target, [long_arm, fails])
    assert len(count) == 2 and unwound == [True]  # stopped at its next forward and unwound, not run to the end
    assert not target._forward_pre_hooks
    run_lockstep(target, [forwards(target, 1)])  # the clock was restored: a new lockstep starts


def test_concurrency_lockstep_pair_serves_what_each_loop_serves_alone(target):
    """Plain batched decoding and the scheduler's closed loop (R = 2, 4 prompts) in lockstep: each loop's outputs are
    its outputs alone, the row counts its own steps, and the target's attention is its own again afterwards."""
    from dspark_hf.bench.concurrency import lockstep_pair
    from dspark_hf.decoding.batch_generate import generate_concurrent

    drafter = scheduled_cycle_drafter(target)
    prompts = [[5, 9, 13], [7, 2, 30, 31, 8], [11], [40, 41]]
    before = target.config._attn_implementation
    alone = generate_concurrent(target, None, prompts, max_concurrency=2, max_new_tokens=10)[0]
    (plain, plain_out), (row, out) = lockstep_pair(target, drafter, prompts, 2, 10, ("scheduler", 4), 3, 3, first=1)
    assert plain_out == out == alone and plain["tokens"] == row["tokens"] == 40
    assert plain["arm"] == "plain" and row["arm"] == "scheduler" and plain["steps"] >= row["steps"]
    assert target.config._attn_implementation == before and not target._forward_pre_hooks
