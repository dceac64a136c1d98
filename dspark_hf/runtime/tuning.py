"""Kernel choices measured on the machine at hand: of several ways to compute the same thing, the one that runs
fastest here, timed once per shape and thread count and remembered for the process.

Which CPU kernel wins depends on the machine and not only on the shapes (issue 23): on one AMD EPYC (AVX-512)
oneDNN's prepacked inner product beat torch's stock ``F.linear`` for a single row and folding grouped query heads
slowed a 2-thread step; on another (AVX2 only) the stock kernel was 10-13 % faster for a 1-token forward and
folding 2-33 % faster on 2 threads. Both are exact to float32 rounding, so the choice changes speed only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

TUNE_REPEATS = 7  # interleaved timings of each kernel, median taken
_CHOICES: dict[tuple, int] = {}  # (what, shape..., torch threads) -> index of the faster kernel


def faster(key: tuple, make_kernels: Callable[[], Sequence[Callable[[], object]]],
           repeats: int = TUNE_REPEATS) -> int:
    """Index of the kernel with the lowest median wall-clock time, measured on the first call for ``key`` (with
    torch's current thread count appended) and remembered for the process.

    The kernels are called in turn (``a, b, a, b, ...``) so that a burst of load hits all of them alike: one
    untimed round, then ``repeats`` timed ones, under ``torch.inference_mode``. A tie goes to the first kernel.

    Args:
        key: what is chosen and for which shapes, e.g. ``("linear-1-row", out, in, dtype)``.
        make_kernels: builds the zero-argument callables to time (called only when ``key`` is new).
        repeats: timed calls of each kernel.

    Returns:
        The index into ``make_kernels()`` of the faster kernel.
    """
    key = (*key, torch.get_num_threads())
    if key not in _CHOICES:
        kernels = make_kernels()
        times = [[] for _ in kernels]
        with torch.inference_mode():
            for r in range(repeats + 1):
                for kernel, out in zip(kernels, times):
                    start = time.perf_counter()
                    kernel()
                    if r:  # the first round is the warm-up
                        out.append(time.perf_counter() - start)
        medians = [statistics.median(t) for t in times]
        _CHOICES[key] = medians.index(min(medians))
    return _CHOICES[key]
