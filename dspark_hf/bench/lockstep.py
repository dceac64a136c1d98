"""Lockstep timing: several decoding runs ("arms") on one target, one target forward of each in turn, so that the
machine's drift from minute to minute hits every arm alike (issues 24 and 28).

Why: on a small shared VM the speed drifts 10-15 % between minutes, so two runs timed one after the other (even
paired, plain before and after) differ by more than the few percent a bench has to resolve. In lockstep each arm runs
as a greenlet (a coroutine with its own stack) in the caller's thread, and a forward pre-hook on the shared target
passes a baton at every target forward: the arm about to run a forward switches back to :func:`run_lockstep`, which
switches to the next unfinished arm. So only one arm computes at any moment, the arms advance a step each in turn
(A, B, A, B, ...), and an arm that finishes drops out. An arm's time is the sum of the intervals during which it holds
the baton: its target forwards and everything between them (drafter passes, scheduling, transformers' loop), never
another arm's.

Greenlets, not threads: torch's OpenMP keeps one thread team per OS thread, and with two teams on 2 cores (torch at 2
threads) every parallel region paid a wake-up: a plain closed loop ran ~1.5× slower in a worker thread than in the
main one (R = 1: 12.0 s against 7.6-8.1 s, the 2-core EPYC), alone or not. In one OS thread the arms share the
caller's team and thread count. Torch's grad mode is per thread, so the arms run under ``torch.inference_mode()``,
where their own ``no_grad`` / ``inference_mode`` blocks, entered and left out of order across arms, all mean the same.

The arms must not notice each other: the decoders learn online from ``time.perf_counter`` (the SPS curve's observed
verify times, the draft-or-not gate's step costs, a round's overhead), and another arm's turn inside one of their
timed intervals would change what they decide. So while the lockstep runs, ``time.perf_counter`` read by an arm is
that arm's own clock, the real one minus the time it has spent waiting for the baton (elsewhere it is the real clock).
That is this module's one patch, installed and removed by :func:`run_lockstep`. Anything an arm times itself
(``Run.seconds``, ``generate_concurrent``'s steps, per-user times) is then in its own seconds, as if it ran alone;
a lone arm's lockstep time is its wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_REAL_CLOCK = time.perf_counter  # the process's clock, whatever run_lockstep has installed meanwhile


@dataclass
class LockstepResult:
    """What :func:`run_lockstep` returns, one entry per arm in the order the arms were given.

    Attributes:
        values: each arm's return value.
        seconds: each arm's time, seconds: the sum of the intervals it held the baton (from its first turn to its
            return), on the lockstep's clock.
        forwards: target forwards each arm ran.
        order: the arm (index) of every target forward, in the order they ran: with two arms ``[a, b, a, b, ...]``
            until one finishes.
    """

    values: list[Any]
    seconds: list[float]
    forwards: list[int]
    order: list[int] = field(default_factory=list)


class _Baton:
    """The arms of one :func:`run_lockstep` and their clocks."""

    def __init__(self, arms: Sequence[Callable[[], Any]], clock: Callable[[], float]):
        from greenlet import greenlet

        self.clock, self.current = clock, greenlet.getcurrent
        self.greenlets = [greenlet(arm) for arm in arms]
        self.index = {g: i for i, g in enumerate(self.greenlets)}
        n = len(arms)
        self.held, self.waited, self.left = [0.0] * n, [0.0] * n, [None] * n  # left: when it last gave the baton
        self.forwards, self.order = [0] * n, []

    def before_forward(self, module, args) -> None:
        """The target's forward pre-hook: an arm gives the baton back to :meth:`turn` (unless it runs alone)."""
        arm = self.index.get(self.current())
        if arm is None:
            return
        if any(not g.dead for i, g in enumerate(self.greenlets) if i != arm):
            self.current().parent.switch()
        self.forwards[arm] += 1
        self.order.append(arm)

    def turn(self, arm: int) -> Any:
        """Run ``arm`` up to its next target forward (or its end), on the clock; returns what the arm returned once
        it has ended."""
        start = self.clock()
        if self.left[arm] is not None:
            self.waited[arm] += start - self.left[arm]
        try:
            return self.greenlets[arm].switch()
        finally:
            self.left[arm] = self.clock()
            self.held[arm] += self.left[arm] - start

    def own_clock(self) -> float:
        """``time.perf_counter`` as the arms see it: an arm reads the lockstep's clock minus its waits."""
        arm = self.index.get(self.current())
        return _REAL_CLOCK() if arm is None else self.clock() - self.waited[arm]


def run_lockstep(target: torch.nn.Module, arms: Sequence[Callable[[], Any]], first: int = 0,
                 clock: Callable[[], float] = _REAL_CLOCK) -> LockstepResult:
    """Run the ``arms`` (callables without arguments, each running its own forwards of ``target``) in lockstep, one
    target forward of each in turn (module docstring), and return their values and times.

    Args:
        target: the model whose forwards pass the baton (a forward pre-hook for the duration of the call).
        arms: the runs; each holds the baton from its first turn to its first target forward, then from each forward
            to the next, then to its return.
        first: the arm that takes the first turn (the next ones follow in cyclic order): rotate it between calls so
            that no arm always starts.
        clock: the seconds clock the times are taken on (a fake one in tests).

    Returns:
        :class:`LockstepResult`.

    Raises:
        the first exception an arm raised (the other arms are unwound first: their ``finally`` blocks and context
            managers run).
        RuntimeError: a lockstep is already running in this process.
        ValueError: no arms, or ``first`` out of range.
    """
    if not arms or not 0 <= first < len(arms):
        raise ValueError(f"run_lockstep needs arms and 0 <= first < {len(arms)}, got first = {first}.")
    if time.perf_counter is not _REAL_CLOCK:
        raise RuntimeError("a lockstep is already running in this process (time.perf_counter is patched).")
    baton, n = _Baton(arms, clock), len(arms)
    values = [None] * n
    handle = target.register_forward_pre_hook(baton.before_forward)
    time.perf_counter = baton.own_clock  # the arms' own clocks (module docstring)
    try:
        with torch.inference_mode():
            arm = first
            while not all(g.dead for g in baton.greenlets):
                if not baton.greenlets[arm].dead:
                    value = baton.turn(arm)
                    if baton.greenlets[arm].dead:
                        values[arm] = value
                arm = (arm + 1) % n
    finally:
        for g in baton.greenlets:  # after a failure: unwind the others (GreenletExit at their switch)
            if g:  # started and not dead
                g.throw()
        time.perf_counter = _REAL_CLOCK
        handle.remove()
    return LockstepResult(values=values, seconds=list(baton.held), forwards=list(baton.forwards), order=baton.order)
