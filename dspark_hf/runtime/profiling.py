"""The SPS curve: target steps per second when verifying ``B`` tokens at once (paper §3.2.2, §5.2).

The hardware-aware scheduler (:mod:`dspark_hf.decoding.scheduler`) needs ``SPS(B)`` for ``B = 1..γ + 1``. The paper
profiles it "once during engine initialization and stored as a lightweight cost table"; here
:func:`profile_sps` measures it on the target's own device, :func:`load_or_profile_sps` keeps one JSON per
(target, device incl. torch thread count, dtype, torch version, linear kernels, context length) under
``cache_root() / "sps"`` (``$HF_HOME/dspark_hf/sps``; delete a file, or run ``dspark profile --refresh``, to
measure again), and :meth:`SPSCurve.observe` refines it online from the verification times that every
speculative round measures anyway (:class:`~dspark_hf.decoding.candidate_generator.DSparkCandidateGenerator` calls it).

Context length. The curve's SHAPE depends on how many tokens are already in the KV cache (attention over
the cache grows with ``B × context``): on a 2-core CPU verifying 8 tokens costs ~1.1× one token at context
256 but ~2.5× at context 4096. A curve therefore holds one row per measured context length and
:meth:`SPSCurve.at` interpolates the cost in milliseconds linearly between the two nearest rows (clamped
outside them). Online observations go to the row of their context (a new power-of-two row is added, seeded
by interpolation, when no row lies within a factor √2).

Measurement (:func:`profile_sps`): prefill the shortest context's random tokens once into the cache ``generate`` uses
and make longer contexts by repeating the cached keys/values (timing does not depend on their values, and a
real prefill of thousands of tokens would cost more than the whole profile). One untimed warm-up sweep over
``B = 1..max_tokens``, then per context timed sweeps until every median is known to ``rel_tol`` (95 %
confidence half-width ``1.57 · IQR / √n``, the boxplot notch of McGill, Tukey and Larsen 1978), or
``max_repeats``, or the context's share of the time budget (default 25 s). A curve whose medians stay wider than ``NOISY_SPREAD`` is marked ``noisy`` and a
:class:`NoisySPSWarning` says so (it is still cached and used: online refinement heals it). Sweeping all ``B``
per repeat, rather than repeating one ``B`` at a time, spreads a burst of load over all sizes instead of
bending the curve at a few of them.

Threads. On a CPU shared with other work, torch's default of one intra-op thread per core collapses: on a
busy 2-core machine a 1-token step of SmolLM2-135M took a median of 1.3 s with 2 threads against 82 ms with
1 (see the README's "Threads and load"). The ``dspark`` commands therefore default to ``--threads 1`` on CPU;
the thread count is part of the cache key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..defaults import cache_digest, cache_root, write_cache_file
from .kv_cache import GrowingLayer, generation_cache
from .machine import describe_machine, device_name
from .targets import kernels_label

__all__ = [
    "ensure_sps_curve",
    "extend_sps",
    "grow_cache",
    "load_or_profile_sps",
    "profile_sps",
    "save_sps",
    "sps_cache_path",
    "time_verify_step",
]

from .sps import DEFAULT_CONTEXTS, NOISY_SPREAD, REL_TOL, NoisySPSWarning, SPSCurve


def _describe(target: torch.nn.Module) -> dict:
    """Metadata of ``target`` that identifies its SPS curve (everything but the measurement)."""
    param, machine = next(target.parameters()), describe_machine()
    return {
        "target_name": str(getattr(target.config, "_name_or_path", "") or ""),
        "device_name": device_name(param.device, machine),
        "dtype": str(param.dtype).removeprefix("torch."),
        "torch_version": machine.torch,
        "n_params": sum(p.numel() for p in target.parameters()),
        "linear_kernels": kernels_label(target),
    }


@torch.inference_mode()
def time_verify_step(target: torch.nn.Module, cache: DynamicCache, input_ids: torch.Tensor) -> float:
    """Time one verification forward of ``input_ids`` against ``cache``, then crop the cache back.

    Args:
        target: a causal LM accepting ``input_ids=`` and ``cache=`` (transformers 5.x).
        cache: a filled ``DynamicCache``; its length is the same on return.
        input_ids: ``torch.LongTensor`` of shape ``(1, B)`` on the target's device.

    Returns:
        Wall-clock seconds of the forward (CUDA is synchronized before and after).
    """
    is_cuda = input_ids.device.type == "cuda"
    if is_cuda:  # start from an idle device so earlier queued work is not timed
        torch.cuda.synchronize(input_ids.device)
    start = time.perf_counter()
    target(input_ids=input_ids, cache=cache, use_cache=True)
    if is_cuda:  # kernels are asynchronous: wait for them before reading the clock
        torch.cuda.synchronize(input_ids.device)
    elapsed = time.perf_counter() - start
    cache.crop(-input_ids.shape[1])  # transformers 5.x: negative count of tokens to drop
    return elapsed


def _check_profile_args(target: torch.nn.Module, max_tokens: int, context_len: int, max_repeats: int,
                        min_repeats: int) -> int | None:
    """Raise ``ValueError`` early for arguments the measurement cannot honour; return the position limit."""
    if max_tokens < 1 or context_len < 1 or min_repeats < 2 or max_repeats < min_repeats:
        raise ValueError("max_tokens and context_len must be >= 1, min_repeats >= 2 (a spread needs two timings) "
                         f"and max_repeats >= min_repeats, got {max_tokens}, {context_len}, {min_repeats}, {max_repeats}.")
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and context_len + max_tokens > limit:
        raise ValueError(f"context_len + max_tokens = {context_len + max_tokens} exceeds the target's "
                         f"max_position_embeddings = {limit}; lower context_len or max_tokens.")
    return limit


def _relative_spread(times: Sequence[float]) -> float:
    """Relative 95 % half-width of the median of ``times`` (``n >= 2``): ``1.57 · IQR / √n / median``
    (McGill, Tukey and Larsen 1978)."""
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return 1.57 * (q3 - q1) / math.sqrt(len(times)) / statistics.median(times)


def grow_cache(target: torch.nn.Module, kv: DynamicCache, context_len: int) -> None:
    """Lengthen ``kv`` (filled, batch 1) to ``context_len`` tokens by repeating its keys/values: timing does not
    depend on their values, and a real prefill of thousands of tokens costs seconds. A real prefill where the
    cache has layers other than plain :class:`DynamicLayer` / :class:`~dspark_hf.runtime.kv_cache.GrowingLayer`
    (e.g. sliding windows)."""
    have = kv.get_seq_length()
    if context_len <= have:
        return
    if all(type(layer) in (DynamicLayer, GrowingLayer) for layer in kv.layers):
        reps = -(-context_len // have)
        for layer in kv.layers:
            keys, values = (t.repeat(1, 1, reps, 1)[:, :, have:context_len] for t in (layer.keys, layer.values))
            layer.update(keys, values)
        return
    vocab = target.get_input_embeddings().num_embeddings
    extra = torch.randint(vocab, (1, context_len - have), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        target(input_ids=extra.to(next(target.parameters()).device), cache=kv, use_cache=True)


def _measure_row(target, kv, blocks, rel_tol: float, min_repeats: int, max_repeats: int, share_end: float,
                 hard_end: float, bar) -> tuple[list[float], float]:
    """Timed sweeps over ``blocks`` until the stopping rule holds: ``(steps_per_s, spread)``.

    Stops once ``min_repeats`` sweeps are done and every median is tight or this context's share of the
    budget (``share_end``) is spent; stops after 2 sweeps, whatever the spread, once ``hard_end`` has passed.
    """
    seconds = [[] for _ in blocks]
    for sweep in range(1, max_repeats + 1):
        for block, times in zip(blocks, seconds):
            times.append(time_verify_step(target, kv, block))
        bar.update(1)
        if sweep < 2:
            continue
        spread = max(_relative_spread(times) for times in seconds)
        now = time.perf_counter()
        if (sweep >= min_repeats and (spread <= rel_tol or now >= share_end)) or now >= hard_end:
            break
    return [1.0 / statistics.median(times) for times in seconds], spread


def profile_sps(
    target: torch.nn.Module,
    max_tokens: int = 8,
    context_len: int = 256,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    rel_tol: float = REL_TOL,
    min_repeats: int = 3,
    max_repeats: int = 30,
    time_budget_s: float = 25.0,
    smooth: bool = False,
    cache: bool = True,
    progress: bool = True,
) -> SPSCurve:
    """Measure ``SPS(B)`` for ``B = 1..max_tokens`` at several context lengths (paper §3.2.2).

    Always measures (:func:`load_or_profile_sps` reuses a stored curve). Random ids from a fixed seed, batch 1, the
    global RNG untouched, the target in its own train/eval mode (load it with ``.eval()``); stopping rule: module docstring.

    Args:
        target: causal LM (transformers 5.x) with ``config`` and ``get_input_embeddings``.
        max_tokens: largest verification size ``B`` (the drafter's ``γ + 1``; more costs time for nothing).
        context_len: the primary row's context (tokens prefilled into the KV cache).
        contexts: further context lengths to measure; those beyond ``max_position_embeddings - max_tokens``
            are skipped. All rows are measured shortest first on one growing cache.
        rel_tol: stop once every median's relative 95 % half-width is at most this.
        min_repeats / max_repeats: timed sweeps per context, at least (within the budget) / at most.
        time_budget_s: wall-clock seconds for the whole profile (target loading excluded), shared evenly by
            the contexts not yet measured. Past it a context stops after 2 sweeps and further contexts other
            than ``context_len`` are skipped (:meth:`SPSCurve.observe` adds their rows online).
        smooth: return the running-minimum curve (monotone non-increasing); the cache keeps raw values.
        cache: also write the raw curve to :func:`sps_cache_path` (replacing any stored one).
        progress: show a tqdm bar over the sweeps.

    Returns:
        :class:`SPSCurve` in forward passes per second, ``noisy`` set when the spread stayed above
        ``NOISY_SPREAD``.

    Raises:
        ValueError: ``max_tokens`` or ``context_len`` below 1, ``min_repeats`` below 2, ``max_repeats <
            min_repeats``, or ``context_len + max_tokens`` beyond ``max_position_embeddings``.

    Warns:
        NoisySPSWarning: the curve is noisy (other load on the machine); it is cached and used anyway.
    """
    limit = _check_profile_args(target, max_tokens, context_len, max_repeats, min_repeats)
    order = sorted({c for c in contexts if c > 0 and (limit is None or c + max_tokens <= limit)} | {context_len})
    rows, spread = _sweep_contexts(target, order, context_len, range(1, max_tokens + 1), time_budget_s, progress,
                                   rel_tol=rel_tol, min_repeats=min_repeats, max_repeats=max_repeats)
    curve = SPSCurve(steps_per_s=rows.pop(context_len), context_len=context_len, context_curves=rows,
                     noisy=spread > NOISY_SPREAD, spread=spread, device_type=next(target.parameters()).device.type,
                     **_describe(target))
    if curve.noisy:
        warnings.warn(_noisy_message(curve), NoisySPSWarning, stacklevel=2)
    if cache:
        write_cache_file(sps_cache_path(target, context_len), curve.to_json())
    return curve.smooth() if smooth else curve


def extend_sps(target: torch.nn.Module, curve: SPSCurve, max_tokens: int, rel_tol: float = REL_TOL,
               min_repeats: int = 3, max_repeats: int = 30, time_budget_s: float = 25.0,
               progress: bool = True) -> SPSCurve:
    """A copy of ``curve`` (raw, as stored) that covers ``B = 1..max_tokens``: the sizes it lacks are measured now,
    every row and online refinement it has is kept (paper §3.2.2).

    A call that verifies more tokens than the stored curve covers (a padded batch, the concurrent engine's merged
    forwards of up to 32 tokens) used to measure the whole curve again within the same budget, which kept fewer
    context rows (256 and 1k of 256-4k on a 2-core CPU) and dropped the online refinements. Here the sizes
    ``B = m..max_tokens`` (``m = curve.max_tokens``, the anchor) are timed at each of the curve's context rows,
    shortest first, as :func:`profile_sps` times its rows (same stopping rule and budget), and row ``r`` gets
    ``SPS_r(B) = SPS_r(m) · new(B) / new(m)``: the new sizes in proportion to the anchor as measured in the same
    sweeps, so a machine whose speed has drifted since the curve was measured does not bend it at ``m``. A row not
    timed (out of the budget, or beyond ``max_position_embeddings``) takes the proportions of the nearest timed row.

    Args:
        target: the curve's target, on the device it was measured on.
        curve: the stored curve; returned unchanged (a copy) when it already covers ``max_tokens``.
        max_tokens: the largest ``B`` needed.
        rel_tol / min_repeats / max_repeats / time_budget_s / progress: as :func:`profile_sps`.

    Returns:
        :class:`SPSCurve`: the longer curve (``noisy`` also set when the new sweeps were).

    Raises:
        ValueError: as :func:`profile_sps` for ``max_tokens`` at the curve's primary context.
    """
    anchor = curve.max_tokens
    if max_tokens <= anchor:
        return dataclasses.replace(curve)
    limit = _check_profile_args(target, max_tokens, curve.context_len, max_repeats, min_repeats)
    order = [c for c in curve.rows if limit is None or c + max_tokens <= limit]
    measured, spread = _sweep_contexts(target, order, curve.context_len, range(anchor, max_tokens + 1),
                                       time_budget_s, progress, rel_tol=rel_tol, min_repeats=min_repeats,
                                       max_repeats=max_repeats)

    def extended(ctx: int, row: list[float]) -> list[float]:
        new = measured[min(measured, key=lambda k: abs(math.log2(ctx / k)))]  # its own, or the nearest timed row
        return row + [row[-1] * s / new[0] for s in new[1:]]

    rows = {ctx: extended(ctx, row) for ctx, row in curve.rows.items()}
    return dataclasses.replace(
        curve, steps_per_s=rows.pop(curve.context_len), context_curves=rows, spread=max(curve.spread, spread),
        noisy=curve.noisy or spread > NOISY_SPREAD,
        counts={ctx: n + [0] * (max_tokens - anchor) for ctx, n in curve.counts.items()})


def _sweep_contexts(target: torch.nn.Module, order: Sequence[int], context_len: int, sizes: Sequence[int],
                    time_budget_s: float, progress: bool, **stopping) -> tuple[dict[int, list[float]], float]:
    """Prefill the shortest context of ``order`` (ascending, ``context_len`` among them), one untimed sweep over
    the verification sizes ``sizes``, then :func:`_measure_rows` within ``time_budget_s``: ``({context:
    steps_per_s of sizes}, the widest spread)``."""
    start = time.perf_counter()
    kv, blocks = _prefilled_cache(target, order[0], sizes)
    with tqdm(desc="Profiling SPS(B)", unit="sweep", disable=not progress) as bar:
        for block in blocks:  # one untimed sweep: allocator, kernel selection
            time_verify_step(target, kv, block)
        return _measure_rows(target, kv, blocks, order, context_len, start + time_budget_s, bar, **stopping)


def _prefilled_cache(target: torch.nn.Module, context_len: int,
                     sizes: Sequence[int]) -> tuple[DynamicCache, list[torch.Tensor]]:
    """The cache ``generate`` runs with, prefilled with ``context_len`` random tokens (seed 0; the global RNG is
    untouched), and a random verification block ``[1, B]`` for each ``B`` of ``sizes``."""
    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    kv = generation_cache(target)
    with torch.inference_mode():
        context = torch.randint(vocab, (1, context_len), generator=generator).to(device)  # (1, context_len)
        target(input_ids=context, cache=kv, use_cache=True)
    blocks = [torch.randint(vocab, (1, b), generator=generator).to(device) for b in sizes]  # (1, B)
    return kv, blocks


def _measure_rows(target, kv, blocks, order: Sequence[int], context_len: int, hard_end: float, bar,
                  **stopping) -> tuple[dict[int, list[float]], float]:
    """Measure one row per context of ``order`` (ascending) on the growing cache ``kv``: ``({context:
    steps_per_s}, the widest spread)``. Each context gets an even share of the time left before ``hard_end``;
    past it, contexts other than ``context_len`` are skipped (online refinement adds their rows when they occur).
    ``stopping``: ``rel_tol``, ``min_repeats``, ``max_repeats`` of :func:`_measure_row`."""
    rows, spreads = {}, []
    for i, ctx in enumerate(order):
        if ctx != context_len and time.perf_counter() >= hard_end:
            continue
        grow_cache(target, kv, ctx)
        share_end = time.perf_counter() + (hard_end - time.perf_counter()) / (len(order) - i)
        bar.set_postfix(context=ctx)
        rows[ctx], spread = _measure_row(target, kv, blocks, share_end=share_end, hard_end=hard_end, bar=bar,
                                         **stopping)
        spreads.append(spread)
    return rows, max(spreads)


def _noisy_message(curve: SPSCurve) -> str:
    return (f"The SPS curve of {curve.target_name or 'this target'} is noisy (medians known only to "
            f"±{100 * curve.spread:.0f} %): the timings varied between sweeps (other load, or a VM whose speed "
            "drifts). It is used anyway and refined online from each round's verification time; for a clean one run "
            "`dspark profile --refresh` on a quiet machine "
            "(on a machine with other load use --threads 1: more torch threads than idle cores collapse).")


def sps_cache_path(target: torch.nn.Module, context_len: int = 256) -> Path:
    """Where the SPS curve of ``target`` on its current device is stored.

    ``cache_root() / "sps" / "<name>-<dtype>-ctx<context_len>-<hash>.json"``; the hash covers target name,
    parameter count, device name (incl. torch's thread count), dtype, torch version, linear kernels and
    ``context_len``. ``cache_root()`` follows ``HF_HOME`` at call time. Delete the file to re-profile.
    """
    key = {**_describe(target), "context_len": context_len}
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key["target_name"].rstrip("/").split("/")[-1]) or "unnamed"
    return cache_root() / "sps" / f"{name}-{key['dtype']}-ctx{context_len}-{cache_digest(key)}.json"


def save_sps(curve: SPSCurve, target: torch.nn.Module) -> Path:
    """Store ``curve`` (e.g. after online refinement) as the cached curve of ``target``; returns the path."""
    path = sps_cache_path(target, curve.context_len)
    write_cache_file(path, curve.to_json())
    return path


def load_or_profile_sps(
    target: torch.nn.Module,
    max_tokens: int = 8,
    context_len: int = 256,
    smooth: bool = False,
    progress: bool = True,
    **profile_kwargs,
) -> SPSCurve:
    """The stored SPS curve for ``target`` on its device, profiling and storing it on a miss (paper §3.2.2).

    A stored curve shorter than ``max_tokens`` is extended (:func:`extend_sps`: its missing sizes measured, its rows
    and online refinements kept) and stored again.

    Args:
        Same as :func:`profile_sps` (``profile_kwargs`` and ``progress`` matter only when something is measured;
        an extension ignores ``contexts``).

    Returns:
        :class:`SPSCurve` (smoothed on request; the stored file keeps raw values).

    Raises:
        ValueError: as :func:`profile_sps`, or a stored file of an unknown format version.

    Warns:
        NoisySPSWarning: the stored or new curve is marked noisy (a stored one only until it has healed online:
            :attr:`SPSCurve.healed`).
    """
    path = sps_cache_path(target, context_len)
    curve = SPSCurve.from_json(path.read_text()) if path.is_file() else None
    if curve is None:
        return profile_sps(target, max_tokens, context_len, smooth=smooth, cache=True, progress=progress,
                           **profile_kwargs)
    if curve.max_tokens < max_tokens:
        profile_kwargs.pop("contexts", None)  # the stored curve's rows are the ones extended
        curve = extend_sps(target, curve, max_tokens, progress=progress, **profile_kwargs)
        write_cache_file(path, curve.to_json())
    if curve.noisy and not curve.healed:  # healed: online refinement has replaced the noisy measurement
        warnings.warn(_noisy_message(curve) + f" (cached in {path})", NoisySPSWarning, stacklevel=2)
    return curve.smooth() if smooth else curve


def ensure_sps_curve(target: torch.nn.Module, drafter, min_tokens: int, max_tokens: int | None = None) -> SPSCurve:
    """The SPS curve a call needs, given to ``drafter``: its own (``drafter.sps_curve``) when it covers ``min_tokens``
    verified tokens, else :func:`load_or_profile_sps` to ``max_tokens`` (default ``min_tokens``) — the stored
    curve of this target on this machine, or one measured now (about 25 s on a CPU, then stored) — set with
    ``drafter.set_sps_curve``.

    Raises:
        ValueError: as :func:`profile_sps`.
    """
    curve = drafter.sps_curve
    if curve is None or curve.max_tokens < min_tokens:
        curve = load_or_profile_sps(target, max_tokens=max(min_tokens, max_tokens or 0))
        drafter.set_sps_curve(curve)
    return curve
