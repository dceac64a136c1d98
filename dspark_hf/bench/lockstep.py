"""Lockstep timing: several decoding runs ("arms") on one target, one target forward of each in turn, so that the
machine's drift from minute to minute hits every arm alike (issues 24 and 28).

Why: on a small shared VM the speed drifts 10-15 % between minutes, so two runs timed one after the other (even
paired, plain before and after) differ by more than the few percent a bench has to resolve. In lockstep each arm runs
in its own Python thread, and a forward pre-hook on the shared target passes a baton at every target forward: the
arm about to run a forward hands the baton to the next unfinished arm and waits for it to come back. So only one
arm computes at any moment, the arms advance a step each in turn (A, B, A, B, ...), and an arm that finishes drops
out. An arm's time is the sum of the intervals during which it holds the baton: its target forwards and everything
between them (drafter passes, scheduling, transformers' loop), never another arm's.

The arms must not notice the others: the decoders learn online from ``time.perf_counter`` (the SPS curve's
observed verify times, the draft-or-not gate's step costs, a round's overhead), and a wait inside one of their timed
intervals would change what they decide. So while the lockstep runs, ``time.perf_counter`` read from an arm's thread
is that arm's own clock, the real one minus the time it has spent waiting for the baton (other threads read the real
clock). That is this module's one patch, installed and removed by :func:`run_lockstep`. Anything an arm times itself
(``Run.seconds``, ``generate_concurrent``'s steps, per-user times) is then in its own seconds, as if it ran alone.

A lone arm's lockstep time is its plain wall time (the hook then returns at once). Every arm thread checks that
torch runs at the caller's thread count (``torch.get_num_threads``). With more than one torch thread, every arm's
thread has its own OpenMP team; a team that is not computing sleeps after its spin.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_REAL_CLOCK = time.perf_counter  # the process's clock, whatever run_lockstep has installed meanwhile


class LockstepAborted(RuntimeError):
    """Raised inside an arm when another arm of the same lockstep failed: the lockstep stops at the next forward."""


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
        threads: ``torch.get_num_threads()`` in each arm's thread.
    """

    values: list[Any]
    seconds: list[float]
    forwards: list[int]
    order: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)


class _Baton:
    """The turn of :func:`run_lockstep`'s arms; every field is read and written under ``cond``."""

    def __init__(self, n: int, first: int, clock: Callable[[], float]):
        self.cond, self.clock = threading.Condition(), clock
        self.turn, self.done, self.aborted = first, [False] * n, False
        self.held, self.waited, self.acquired = [0.0] * n, [0.0] * n, [0.0] * n
        self.forwards, self.order, self.arm_of = [0] * n, [], {}  # arm_of: thread ident -> arm index

    def take(self, arm: int, since: float | None) -> None:
        """Wait for ``arm``'s turn (``since``: when it handed the baton on, or ``None`` at its start); raises
        :class:`LockstepAborted` when another arm failed."""
        with self.cond:
            self.cond.wait_for(lambda: self.turn == arm or self.aborted)
            if self.aborted:
                raise LockstepAborted("another arm of the lockstep failed")
            self.acquired[arm] = self.clock()
            if since is not None:
                self.waited[arm] += self.acquired[arm] - since

    def give(self, arm: int, finished: bool = False) -> float:
        """End ``arm``'s turn and hand the baton to the next unfinished arm (``arm`` itself when it is the last);
        returns when the turn ended."""
        with self.cond:
            now = self.clock()
            if self.turn == arm:  # not so for an arm stopped by another's failure while it waited
                self.held[arm] += now - self.acquired[arm]
            self.done[arm] = self.done[arm] or finished
            n = len(self.done)
            self.turn = next(((arm + k) % n for k in range(1, n + 1) if not self.done[(arm + k) % n]), arm)
            self.cond.notify_all()
            return now

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def before_forward(self, module, args) -> None:
        """The target's forward pre-hook: an arm's thread passes the baton on and waits for its next turn (other
        threads' forwards pass through)."""
        arm = self.arm_of.get(threading.get_ident())
        if arm is None:
            return
        with self.cond:
            alone = all(d for i, d in enumerate(self.done) if i != arm)
        if not alone:
            self.take(arm, self.give(arm))
        with self.cond:
            self.forwards[arm] += 1
            self.order.append(arm)

    def own_clock(self) -> float:
        """``time.perf_counter`` as the arms see it: an arm's thread reads the lockstep's clock minus its waits."""
        arm = self.arm_of.get(threading.get_ident())
        return _REAL_CLOCK() if arm is None else self.clock() - self.waited[arm]


def run_lockstep(target: torch.nn.Module, arms: Sequence[Callable[[], Any]], first: int = 0,
                 clock: Callable[[], float] = _REAL_CLOCK) -> LockstepResult:
    """Run the ``arms`` (callables without arguments, each running its own forwards of ``target``) in lockstep, one
    target forward of each in turn (module docstring), and return their values and times.

    Args:
        target: the model whose forwards pass the baton (a forward pre-hook for the duration of the call).
        arms: the runs; each runs in its own thread, holding the baton from its first turn to its first target
            forward, then from each forward to the next, then to its return.
        first: the arm that takes the first turn (the next ones follow in cyclic order): rotate it between calls so
            that no arm always starts.
        clock: the seconds clock the times are taken on (a fake one in tests).

    Returns:
        :class:`LockstepResult`.

    Raises:
        the first exception an arm raised (the other arms stop at their next target forward).
        RuntimeError: an arm's thread runs torch at a thread count other than the caller's, or a lockstep is already
            running in this process.
        ValueError: no arms, or ``first`` out of range.
    """
    if not arms or not 0 <= first < len(arms):
        raise ValueError(f"run_lockstep needs arms and 0 <= first < {len(arms)}, got first = {first}.")
    if time.perf_counter is not _REAL_CLOCK:
        raise RuntimeError("a lockstep is already running in this process (time.perf_counter is patched).")
    baton, threads, workers = _Baton(len(arms), first, clock), torch.get_num_threads(), []
    values, errors, counts = [None] * len(arms), [], [0] * len(arms)

    def work(arm: int) -> None:
        baton.arm_of[threading.get_ident()] = arm
        try:
            baton.take(arm, None)
            counts[arm] = torch.get_num_threads()
            if counts[arm] != threads:
                raise RuntimeError(f"torch runs {counts[arm]} threads in a lockstep arm, {threads} in its caller.")
            values[arm] = arms[arm]()
        except BaseException as error:  # re-raised by run_lockstep once every arm has stopped
            with baton.cond:
                errors.append(error)
            baton.abort()
        finally:
            baton.give(arm, finished=True)

    handle = target.register_forward_pre_hook(baton.before_forward)
    time.perf_counter = baton.own_clock  # the arms' own clocks (module docstring)
    try:
        workers = [threading.Thread(target=work, args=(arm,), name=f"lockstep-arm-{arm}") for arm in range(len(arms))]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
    finally:
        time.perf_counter = _REAL_CLOCK
        handle.remove()
    if errors:  # the failure itself, not the arms it stopped
        raise next((e for e in errors if not isinstance(e, LockstepAborted)), errors[0])
    return LockstepResult(values=values, seconds=list(baton.held), forwards=list(baton.forwards), order=baton.order,
                          threads=counts)
