"""Kernel choices measured on the machine at hand: of several ways to compute the same thing, the one that runs
fastest here, timed once per shape, thread count and machine and stored on disk for later processes.

Which CPU kernel wins depends on the machine and not only on the shapes (issue 23): on one AMD EPYC (AVX-512)
oneDNN's prepacked inner product beat torch's stock ``F.linear`` for a single row and folding grouped query heads
slowed a 2-thread step; on another (AVX2 only) the stock kernel was 10-13 % faster for a 1-token forward and
folding 2-33 % faster on 2 threads. Both are exact to float32 rounding, so the choice changes speed only.

Where choices are stored. Timing them cost a process that loads SmolLM2-135M 2.0-3.5 s (the 1-token forward of the
linear kernels most of it; the attention's choices 25-35 ms), and two close kernels can come out in either order:
head by head at 1 thread won in 9 of 10 processes on one EPYC. The choices are part of the SPS curve's cache key
(:func:`~dspark_hf.runtime.targets.kernels_label`), so a process whose choice flipped profiled the curve again. So
:func:`faster` measures a choice once and stores it, with each kernel's median (ms), in ``cache_root() / "kernels" /
<machine> / <what>-<key>.json`` (``$HF_HOME/dspark_hf/kernels``, :func:`choices_dir`), the machine's folder named by a
hash of the CPU model, instruction set, cores and torch's thread count
(:attr:`~dspark_hf.runtime.machine.Machine.cpu_label`) and the torch version; later processes read it (~3 ms). To
measure again (on a quiet machine): ``dspark profile --refresh`` (:func:`forget_choices`, this machine at the current
thread count), or delete the ``kernels`` folder.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..defaults import cache_digest, cache_root, write_cache_file
from .machine import describe_machine

TUNE_REPEATS = 7  # interleaved timings of each kernel, median taken
STORE_FORMAT = 1  # part of the stored choices' folder name: raise it when a timing changes, so choices are re-measured
_CHOICES: dict[tuple, int] = {}  # (what, shape..., torch threads) -> index of the faster kernel, for this process


def faster(key: tuple, make_kernels: Callable[[], Sequence[Callable[[], object]]],
           repeats: int = TUNE_REPEATS) -> int:
    """Index of the kernel with the lowest median wall-clock time for ``key`` (with torch's current thread count
    appended): remembered for the process, read from :func:`choices_dir` where stored, else measured now and stored.

    The kernels are called in turn (``a, b, a, b, ...``) so that a burst of load hits all of them alike: one
    untimed round, then ``repeats`` timed ones, under ``torch.inference_mode``. A tie goes to the first kernel.

    Args:
        key: what is chosen and for which shapes, e.g. ``("linear-1-row", out, in, dtype)``; its parts are stored
            as ``str``, and the stored index must mean the same kernel to every version that builds this key (name
            the kernels in it where their list can change).
        make_kernels: builds the zero-argument callables to time (called only when ``key`` is measured).
        repeats: timed calls of each kernel.

    Returns:
        The index into ``make_kernels()`` of the faster kernel.

    Warns:
        UserWarning: the stored file is unreadable or not a choice for ``key`` (it is measured again and rewritten),
            or the choice cannot be stored (it is used; the next process measures it again).
    """
    key = (*key, torch.get_num_threads())
    if key not in _CHOICES:
        stored = [str(part) for part in key]  # the key as its file holds it
        path = choices_dir() / f"{key[0]}-{cache_digest(stored)}.json"
        choice = _read_choice(path, stored)
        if choice is None:
            medians = _medians(make_kernels(), repeats)
            choice = medians.index(min(medians))
            _store_choice(path, stored, choice, medians)
        _CHOICES[key] = choice
    return _CHOICES[key]


def _medians(kernels: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each of ``kernels`` over ``repeats`` interleaved timed rounds after an untimed one."""
    times = [[] for _ in kernels]
    with torch.inference_mode():
        for r in range(repeats + 1):
            for kernel, out in zip(kernels, times):
                start = time.perf_counter()
                kernel()
                if r:  # the first round is the warm-up
                    out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def choices_dir() -> Path:
    """Folder of the choices stored for this machine at torch's current thread count: ``cache_root() / "kernels" /
    <hash>``, the hash over :attr:`~dspark_hf.runtime.machine.Machine.cpu_label` (CPU model, instruction set, cores,
    torch threads), the torch version and :data:`STORE_FORMAT`. Follows ``HF_HOME`` at call time."""
    machine = describe_machine()
    return cache_root() / "kernels" / cache_digest([machine.cpu_label, machine.torch, STORE_FORMAT])


def _read_choice(path: Path, key: list[str]) -> int | None:
    """The choice stored in ``path`` for ``key`` (its parts as ``str``); ``None`` where there is none, or (with a
    warning) where the file is unreadable or holds no valid choice for ``key``."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        choice = record["choice"]
        if (record["key"] != key or type(choice) is not int
                or not 0 <= choice < len(record["median_ms"])):
            raise ValueError(f"not a choice for {key}")
        return choice
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"The stored kernel choice {path} is unreadable ({type(err).__name__}: {err}); measuring it "
                      "again.", UserWarning, stacklevel=3)
        return None


def _store_choice(path: Path, key: list[str], choice: int, medians: Sequence[float]) -> None:
    """Write the measured ``choice`` for ``key`` (its parts as ``str``) to ``path`` atomically, with the medians it was
    chosen by (ms); warn (without raising) where it cannot be written."""
    machine = describe_machine()
    record = {"key": key, "choice": choice, "median_ms": [round(1e3 * m, 4) for m in medians],
              "machine": machine.cpu_label, "torch": machine.torch}
    try:
        write_cache_file(path, json.dumps(record, indent=1) + "\n")
    except OSError as err:
        warnings.warn(f"Could not store the kernel choice in {path} ({err}); it is used in this process and measured "
                      "again by the next.", UserWarning, stacklevel=3)


def forget_choices() -> Path:
    """Drop the choices measured at torch's current thread count on this machine, those stored in :func:`choices_dir`
    and those this process remembers, so that each is measured again when next asked for (``dspark profile
    --refresh``). Choices of other thread counts and machines are kept. Returns the folder emptied."""
    threads = torch.get_num_threads()
    for key in [key for key in _CHOICES if key[-1] == threads]:
        del _CHOICES[key]
    folder = choices_dir()
    for path in folder.glob("*.json"):
        path.unlink(missing_ok=True)
    return folder
