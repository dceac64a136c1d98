"""Verification-length scheduling: the hardware-aware prefix scheduler and a static-threshold baseline.

Implements DSpark (paper §3.2.2, Algorithm 1). Symbols follow the paper:

- ``c[k]``: conditional confidence that draft token ``k`` survives given tokens ``1..k-1`` survived.
- ``a[k] = prod_{i<=k} c[i]``: prefix survival probability of draft position ``k``.
- ``ℓ``: number of draft tokens sent for verification (0..γ); the target verifies ``B = 1 + ℓ`` tokens
  per request (the ``+1`` is the last accepted / bonus token that is always fed).
- ``SPS(B)``: measured target steps per second when verifying ``B`` tokens at once
  (see :mod:`dspark_hf.runtime.profiling`). Passed as a sequence ``sps`` with ``sps[B - 1] = SPS(B)``.
- ``Θ = τ · SPS(B)``: expected accepted tokens per second, ``τ`` = expected tokens per step.

All functions here are pure and run on the host: tensors are read with ``.tolist()``, which is a
device sync when they live on an accelerator (γ values per request, so the copy itself is tiny).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence

import torch

__all__ = ["expected_throughputs", "prefix_survival", "schedule_prefix", "schedule_global", "schedule_batch",
           "threshold_prefix"]


def _as_tensor(confidences: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """A floating tensor view of ``confidences`` (sequences and integer tensors become float64)."""
    c = confidences if isinstance(confidences, torch.Tensor) else torch.as_tensor(confidences, dtype=torch.float64)
    return c if c.is_floating_point() else c.to(torch.float64)


def _check_confidences(c: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``c`` has shape ``(..., γ)``, ``γ >= 1``, values in ``[0, 1]``."""
    if c.ndim == 0 or c.shape[-1] == 0:
        raise ValueError(f"confidences must have shape (..., γ) with γ >= 1, got shape {tuple(c.shape)}.")
    if not bool(((c >= 0) & (c <= 1)).all()):
        raise ValueError("confidences must lie in [0, 1] (and not be NaN); pass probabilities, not logits.")


def _one_request(confidences: torch.Tensor | Sequence[float]) -> list[float]:
    """Validated conditional confidences ``c[1..γ]`` of one request, as Python floats.

    A list or tuple of Python floats in ``[0, 1]`` is returned as it is, without torch: the round planner
    (:mod:`dspark_hf.decoding.lookup`) evaluates Θ several times a round, where a tensor's creation and checks cost
    more than the maths. Anything else, valid or not, goes through the tensor checks (same values, same errors)."""
    if isinstance(confidences, (list, tuple)) and confidences and all(
            type(c) is float and 0.0 <= c <= 1.0 for c in confidences):
        return list(confidences)
    c = _as_tensor(confidences)
    if c.ndim != 1:
        raise ValueError(f"one request's confidences must have shape (γ,), got shape {tuple(c.shape)}.")
    _check_confidences(c)
    return c.tolist()


def prefix_survival(confidences: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Prefix survival probabilities ``a[k] = prod_{i<=k} c[i]`` (paper §3.2.2, Algorithm 1 line 2).

    Args:
        confidences: conditional confidences ``c`` of shape ``(..., γ)``, values in ``[0, 1]``.
            A floating tensor keeps its dtype and device; anything else becomes float64.

    Returns:
        ``torch.Tensor`` of shape ``(..., γ)``: cumulative products along the last dimension.

    Raises:
        ValueError: the input is 0-d, has ``γ = 0``, or holds values outside ``[0, 1]`` / NaN.
    """
    c = _as_tensor(confidences)
    _check_confidences(c)
    return torch.cumprod(c, dim=-1)


def _survival_list(confidences: torch.Tensor | Sequence[float]) -> list[float]:
    """``a[1..γ]`` of one request as Python floats, multiplied in float64 left to right."""
    return list(itertools.accumulate(_one_request(confidences), operator.mul))


def _sps_list(sps: Sequence[float]) -> list[float]:
    """Validate the SPS table (index ``B - 1``) and return it as Python floats."""
    values = [float(s) for s in sps]
    if not values:
        raise ValueError("sps is empty; pass the profiled curve, e.g. `load_or_profile_sps(target).steps_per_s`.")
    if not all(math.isfinite(s) and s > 0 for s in values):
        raise ValueError("sps values must be finite and > 0 (steps per second for B = 1, 2, ...).")
    return values


def schedule_prefix(confidences: torch.Tensor | Sequence[float], sps: Sequence[float]) -> int:
    """Verification length ``ℓ`` for one request (Algorithm 1 with ``R = 1``, paper §3.2.2).

    Evaluates ``Θ(ℓ) = (1 + sum_{j<=ℓ} a[j]) · SPS(1 + ℓ)`` for ``ℓ = 1, 2, ...`` in order and stops at
    the first ``ℓ`` with ``Θ(ℓ) <= Θ_best`` (early stop, so admission never looks at confidences
    beyond the first rejected position: the non-anticipating property of Appendix A). Positions with
    ``a[j] = 0`` are never admitted.

    Args:
        confidences: conditional confidences ``c`` of shape ``(γ,)`` (tensor or sequence), in ``[0, 1]``.
        sps: steps per second with ``sps[B - 1] = SPS(B)`` for ``B = 1 .. len(sps)``, all ``> 0``.

    Returns:
        ``ℓ`` in ``0 .. min(γ, len(sps) - 1)``: the number of draft tokens to verify.

    Raises:
        ValueError: empty input, ``confidences`` not 1-D or outside ``[0, 1]``, ``sps`` not positive.
    """
    best, length = None, 0
    for j, a_j, theta in _throughputs(confidences, sps):
        if best is None:
            best = theta
        elif a_j <= 0 or theta <= best:
            break
        else:
            best, length = theta, j
    return length


def _throughputs(confidences, sps):
    """``(ℓ, a[ℓ], Θ(ℓ))`` for ``ℓ = 0 .. min(γ, len(sps) - 1)``, ``Θ(ℓ) = (1 + sum_{j<=ℓ} a[j]) · SPS(1 + ℓ)``
    (``a[0] = 1``); validates both inputs first."""
    a = _survival_list(confidences)
    table = _sps_list(sps)
    tau = 1.0
    yield 0, 1.0, table[0]
    for j, a_j in enumerate(a[: len(table) - 1], start=1):
        tau += a_j
        yield j, a_j, tau * table[j]


def expected_throughputs(confidences: torch.Tensor | Sequence[float], sps: Sequence[float]) -> list[float]:
    """``Θ(ℓ) = (1 + sum_{j<=ℓ} a[j]) · SPS(1 + ℓ)`` for ``ℓ = 0 .. min(γ, len(sps) - 1)`` (paper §3.2.2).

    Args / Raises: as :func:`schedule_prefix`.

    Returns:
        ``list[float]``: expected accepted tokens per second of verifying the first ``ℓ`` drafts, index ``ℓ``.
    """
    return [theta for _, _, theta in _throughputs(confidences, sps)]


def schedule_global(confidences: torch.Tensor | Sequence[float], sps: Sequence[float]) -> int:
    """``argmax_ℓ Θ(ℓ)`` over every ``ℓ``, without the early stop (paper §5.2, asynchronous scheduler).

    The unconstrained search steps over cliffs in a jagged SPS curve (e.g. a CPU where verifying 2
    tokens costs more than verifying 8) that stop Algorithm 1 at ``ℓ = 0``. It leaks the drafts into
    their own admission (Appendix A), so it must only see confidences that no draft of the block
    being verified depends on: the ``"async"`` verification mode passes ``c_1`` of that block (a
    function of the anchor and context only) and ``c_2..c_γ`` of the previous block.

    Args / Raises: as :func:`schedule_prefix`.

    Returns:
        ``ℓ`` in ``0 .. min(γ, len(sps) - 1)`` maximising ``(1 + sum_{j<=ℓ} a[j]) · SPS(1 + ℓ)``;
        ties go to the shorter prefix.
    """
    return max(_throughputs(confidences, sps), key=lambda step: step[2])[0]  # max keeps the first (shortest) tie


def schedule_batch(
    confidences_per_request: Sequence[torch.Tensor | Sequence[float]], sps: Sequence[float], early_stop: bool = True
) -> list[int]:
    """Per-request verification lengths ``ℓ*_1 .. ℓ*_R`` (paper §3.2.2, Algorithm 1, exactly).

    Candidates ``(r, j)`` with ``a[r, j] > 0`` are sorted descending by ``a[r, j]`` (stable: ties keep
    request-then-position order) and admitted one at a time, each adding one token to the batch
    ``B`` (starting from ``B = R``) and ``a[r, j]`` to ``τ`` (starting from ``τ = R``); the loop breaks
    at the first candidate with ``Θ = τ · SPS(B) <= Θ_best`` (``Θ_best`` starts at ``R · SPS(R)``), or
    when ``B`` would exceed ``len(sps)``.

    Admission of ``(r, j)`` depends only on candidates sorted before it: request ``r``'s positions ``< j`` and
    other requests' candidates, never on ``r``'s drafts from position ``j`` on (Appendix A), so each request
    stays exact in law. With ``early_stop=False`` (the §5.2 global search across requests) every candidate is
    evaluated and the best prefix of the sorted list is kept: pass it only confidences that no draft of the
    blocks being verified depends on (the ``"async"`` mode's ``[c_1, c'_2, ..., c'_γ]``).

    Args:
        confidences_per_request: ``R`` conditional-confidence vectors, each of shape ``(γ_r,)`` in
            ``[0, 1]`` (tensors or sequences; ``γ_r`` may differ between requests).
        sps: steps per second with ``sps[B - 1] = SPS(B)``; needs ``len(sps) >= R``.
        early_stop: Algorithm 1's break at the first non-improving candidate (``True``), or the global search.

    Returns:
        ``list[int]`` of length ``R``: ``ℓ*_r`` draft tokens to verify for request ``r``.

    Raises:
        ValueError: no requests, ``len(sps) < R``, or a request's confidences are invalid.
    """
    survivals = [_survival_list(c) for c in confidences_per_request]
    table = _sps_list(sps)
    n_requests = len(survivals)
    if n_requests == 0:
        raise ValueError("confidences_per_request is empty; pass one confidence vector per active request.")
    if n_requests > len(table):
        raise ValueError(f"sps covers B <= {len(table)} but {n_requests} requests need B >= {n_requests}; "
                         "profile a longer curve (max_tokens).")
    # Phase 1: candidate space E, sorted by survival probability (Algorithm 1 lines 1-4).
    candidates = [(a_j, r, j) for r, a in enumerate(survivals) for j, a_j in enumerate(a, start=1) if a_j > 0]
    candidates.sort(key=lambda cand: cand[0], reverse=True)  # list.sort is stable
    # Phase 2: greedy admission with early stop (lines 5-15).
    lengths, admitted = [0] * n_requests, [0] * n_requests
    batch, tau = n_requests, float(n_requests)
    best = tau * table[batch - 1]
    for a_j, r, j in candidates:
        batch, tau = batch + 1, tau + a_j
        if batch > len(table):
            break
        theta = tau * table[batch - 1]
        admitted[r] = j
        if theta > best:
            best, lengths = theta, list(admitted)
        elif early_stop:
            break
    return lengths


def threshold_prefix(confidences: torch.Tensor | Sequence[float], threshold: float) -> int:
    """Static-threshold baseline: verify draft tokens while ``c[k] >= threshold`` (paper §3.2.2, §4).

    The load-independent rule of prior work (and of transformers' ``assistant_confidence_threshold``;
    note transformers' ``ConfidenceCriteria`` also keeps the first token below the threshold, this
    function does not).

    Args:
        confidences: conditional confidences ``c`` of shape ``(γ,)`` in ``[0, 1]``.
        threshold: a probability in ``[0, 1]``.

    Returns:
        ``ℓ`` in ``0 .. γ``: length of the longest prefix whose every ``c[k] >= threshold``.

    Raises:
        ValueError: empty or invalid ``confidences``, or ``threshold`` outside ``[0, 1]``.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a probability in [0, 1], got {threshold}.")
    length = 0
    for c_k in _one_request(confidences):
        if c_k < threshold:
            break
        length += 1
    return length
