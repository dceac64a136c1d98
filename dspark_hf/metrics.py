"""The metrics of DSpark decoding, in one place: τ, conditional acceptance, ECE / Brier / ROC-AUC.

The bench (:mod:`dspark_hf.bench`), calibration (:mod:`dspark_hf.decoding.calibration`), the generation statistics
(:class:`dspark_hf.decoding.stats.GenerationStats`), the demo and the ``evaluate`` modules under ``evaluate_metrics/``
in the repository all call these functions. Symbols follow the paper:

- A *round* is one speculative step; ``accepted`` (``n``) = draft tokens the target accepted in it, bonus
  token excluded (``0..γ``).
- ``τ = mean(n + 1)``: tokens per round including the bonus / correction token (paper Table 1).
- ``c[k]``: conditional confidence of draft position ``k``; ``a[k] = prod_{i<=k} c[i]``: prefix survival
  probability, whose label is ``1[n >= k]`` (paper §3.2.1).
- Conditional label of position ``k``: ``1[n >= k]``, defined only where ``n >= k - 1``; its rate is the
  position-wise conditional acceptance ``P(n >= k | n >= k - 1)`` (paper Fig. 2).

Confidence metrics need FIXED-length rounds (every position verified), so every label is observed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "brier_score",
    "conditional_acceptance",
    "conditional_mask",
    "expected_calibration_error",
    "prefix_survival_metrics",
    "roc_auc",
    "survival_labels",
    "tau",
]


# ----------------------------------------------------------------------------- acceptance
def tau(accepted: Sequence[int]) -> float | None:
    """Mean accepted length per round, bonus token included (paper Table 1): ``mean(n + 1)``.

    Args:
        accepted: draft tokens accepted per round (bonus excluded), any number of rounds.

    Returns:
        τ, or ``None`` for no rounds.
    """
    return sum(n + 1 for n in accepted) / len(accepted) if len(accepted) else None


def conditional_acceptance(accepted: Sequence[int], gamma: int) -> list[float | None]:
    """Position-wise conditional acceptance ``P(n >= k | n >= k - 1)`` for ``k = 1..γ`` (paper Fig. 2).

    Args:
        accepted: draft tokens accepted per round, from rounds that verified all γ drafts.
        gamma: drafts per round γ.

    Returns:
        γ values; ``None`` where no round reached position ``k`` (denominator 0).
    """
    reached = [sum(n >= k for n in accepted) for k in range(gamma + 1)]  # reached[k] = #(n >= k)
    return [reached[k] / reached[k - 1] if reached[k - 1] else None for k in range(1, gamma + 1)]


# ----------------------------------------------------------------------------- input checks


def _check_labels(labels: torch.Tensor, n: int) -> torch.Tensor:
    """``labels`` as float64 ``(n,)`` of 0/1, or ``ValueError``."""
    y = torch.as_tensor(labels)
    if y.shape != (n,):
        raise ValueError(f"labels must have shape ({n},) to match the scores, got {tuple(y.shape)}.")
    y = y.to(torch.float64)
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("labels must be 0/1 (or bool).")
    return y


def _check_probs(probs: torch.Tensor, name: str = "probs") -> torch.Tensor:
    """``probs`` as a non-empty float64 tensor with values in ``[0, 1]``, or ``ValueError``."""
    p = torch.as_tensor(probs).to(torch.float64)
    if p.numel() == 0:
        raise ValueError(f"{name} is empty.")
    if not bool(((p >= 0) & (p <= 1)).all()):
        raise ValueError(f"{name} must lie in [0, 1] (and not be NaN); pass probabilities, not logits.")
    return p


def _check_rounds(confidences: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate fixed-length rounds: ``confidences (N, γ)`` in ``[0, 1]`` and ``accepted (N,)`` in ``0..γ``."""
    c = _check_probs(confidences, "confidences")
    if c.ndim != 2:
        raise ValueError(f"confidences must have shape (N, γ) (one row per round), got {tuple(c.shape)}.")
    n, gamma = c.shape
    n_acc = torch.as_tensor(accepted)
    if n_acc.shape != (n,) or n_acc.is_floating_point() or n_acc.dtype == torch.bool:
        raise ValueError(f"accepted must be an integer tensor of shape ({n},), got {n_acc.dtype} {tuple(n_acc.shape)}.")
    if not bool(((n_acc >= 0) & (n_acc <= gamma)).all()):
        raise ValueError(f"accepted must lie in 0..γ = 0..{gamma} (draft tokens accepted, bonus token excluded).")
    return c, n_acc.long()


# ----------------------------------------------------------------------------- labels


def survival_labels(accepted: torch.Tensor, gamma: int) -> torch.Tensor:
    """Prefix-survival labels ``1[accepted >= k]`` for ``k = 1..γ`` (paper §3.2.1).

    Args:
        accepted: ``torch.LongTensor`` of shape ``(N,)``, draft tokens accepted per round.
        gamma: number of draft positions ``γ``.

    Returns:
        ``torch.FloatTensor`` (float64) of shape ``(N, γ)``.
    """
    k = torch.arange(1, gamma + 1, device=accepted.device)  # (γ,)
    return (accepted[:, None] >= k).to(torch.float64)  # (N, γ)


def conditional_mask(accepted: torch.Tensor, gamma: int) -> torch.Tensor:
    """Where the conditional label of position ``k`` is defined: ``accepted >= k - 1`` (paper §3.2.1).

    Args:
        accepted: ``torch.LongTensor`` of shape ``(N,)``.
        gamma: number of draft positions ``γ``.

    Returns:
        ``torch.BoolTensor`` of shape ``(N, γ)``.
    """
    k = torch.arange(1, gamma + 1, device=accepted.device)  # (γ,)
    return accepted[:, None] >= k - 1  # (N, γ)


# ----------------------------------------------------------------------------- metrics


def _bin_sums(probs: torch.Tensor, labels: torch.Tensor, n_bins: int) -> tuple[torch.Tensor, ...]:
    """Per-column equal-width bin statistics.

    Args:
        probs: float64 ``(N, G)`` in ``[0, 1]``; labels: float64 ``(N,)``.

    Returns:
        ``(counts, sum_probs, sum_labels)``, each float64 ``(G, n_bins)``; bin ``b`` holds
        ``[b / n_bins, (b + 1) / n_bins)``, the last bin also holds 1.0.
    """
    n, g = probs.shape
    bins = (probs * n_bins).floor().long().clamp_(max=n_bins - 1).T  # (G, N)
    zeros = torch.zeros(g, n_bins, dtype=torch.float64)
    counts = zeros.scatter_add(1, bins, torch.ones(g, n, dtype=torch.float64))
    sum_probs = zeros.scatter_add(1, bins, probs.T.contiguous())
    sum_labels = zeros.scatter_add(1, bins, labels.expand(g, n).contiguous())
    return counts, sum_probs, sum_labels


def _ece_columns(probs: torch.Tensor, labels: torch.Tensor, n_bins: int) -> torch.Tensor:
    """ECE of every column of ``probs (N, G)`` against ``labels (N,)``: float64 ``(G,)``."""
    _, sum_probs, sum_labels = _bin_sums(probs, labels, n_bins)
    # sum_b (n_b / N) |mean_p - mean_y| = sum_b |sum_p - sum_y| / N
    return (sum_probs - sum_labels).abs().sum(dim=1) / probs.shape[0]


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> float:
    """Expected Calibration Error (Naeini et al., 2015), as used for STS in paper §3.2.1.

    ``ECE = sum_b (n_b / N) · |mean(probs in b) - mean(labels in b)|`` over ``n_bins`` equal-width bins
    on ``[0, 1]`` (bin ``b`` is ``[b/n, (b+1)/n)``, the last bin includes 1).

    Args:
        probs: predicted probabilities, shape ``(N,)``, in ``[0, 1]``.
        labels: outcomes 0/1 (or bool), shape ``(N,)``.
        n_bins: number of bins, ``>= 1``.

    Returns:
        ECE as a float in ``[0, 1]`` (probability units).

    Raises:
        ValueError: empty input, shape mismatch, values outside ``[0, 1]``, non-binary labels, ``n_bins < 1``.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}.")
    p = _check_probs(probs)
    if p.ndim != 1:
        raise ValueError(f"probs must have shape (N,), got {tuple(p.shape)}.")
    y = _check_labels(labels, p.shape[0])
    return _ece_columns(p[:, None], y, n_bins).item()


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Brier score ``mean((probs - labels)^2)`` (paper §4 calibration diagnostics).

    Args:
        probs: predicted probabilities, shape ``(N,)``, in ``[0, 1]``.
        labels: outcomes 0/1 (or bool), shape ``(N,)``.

    Returns:
        A float in ``[0, 1]``; lower is better.

    Raises:
        ValueError: empty input, shape mismatch, values outside ``[0, 1]``, non-binary labels.
    """
    p = _check_probs(probs)
    if p.ndim != 1:
        raise ValueError(f"probs must have shape (N,), got {tuple(p.shape)}.")
    y = _check_labels(labels, p.shape[0])
    return ((p - y) ** 2).mean().item()


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Hanley and McNeil, 1982), the discrimination metric of paper §4.

    Rank-based (Mann-Whitney U): the probability that a random positive scores above a random
    negative, ties counting one half (average ranks).

    Args:
        scores: real scores, shape ``(N,)`` (any finite values; higher means "more likely positive").
        labels: outcomes 0/1 (or bool), shape ``(N,)``.

    Returns:
        AUC in ``[0, 1]``, or ``nan`` when only one class is present.

    Raises:
        ValueError: empty input, shape mismatch, non-finite scores, non-binary labels.
    """
    s = torch.as_tensor(scores).to(torch.float64)
    if s.ndim != 1 or s.numel() == 0:
        raise ValueError(f"scores must have shape (N,) with N >= 1, got {tuple(s.shape)}.")
    if not bool(torch.isfinite(s).all()):
        raise ValueError("scores must be finite.")
    y = _check_labels(labels, s.shape[0]).bool()
    n_pos = int(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)  # ascending groups
    ends = counts.cumsum(0).to(torch.float64)
    mean_rank = ends - (counts - 1).to(torch.float64) / 2  # 1-based rank, averaged over ties
    rank_sum = mean_rank[inverse][y].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


# ----------------------------------------------------------------------------- prefix survival


def prefix_survival_metrics(confidences: torch.Tensor, accepted: torch.Tensor, n_bins: int = 15) -> dict:
    """ECE, Brier score and ROC-AUC of the prefix survival ``a[k]`` against ``1[n >= k]``, per position.

    Paper §3.2.1 and §4: what the scheduler needs is ``a[k]`` calibrated in absolute terms, so this is
    judged on ``a[k] = prod_{i<=k} c[i]`` (pass calibrated ``c'`` to judge a calibration).

    Args:
        confidences: conditional confidences ``c``, shape ``(N, γ)``, values in ``[0, 1]``, fixed-length rounds.
        accepted: integer tensor of shape ``(N,)``, draft tokens accepted per round, in ``0..γ``.
        n_bins: ECE bins, ``>= 1``.

    Returns:
        ``{"n_rounds", "ece", "brier", "roc_auc", "positions"}``: ``ece``/``brier`` are means over the γ
        positions, ``roc_auc`` the mean over positions where both outcomes occur (``None`` if none);
        ``positions[k - 1]`` holds ``position``, ``survival_rate``, ``ece``, ``brier`` and ``roc_auc``
        (``None`` when one class is absent).

    Raises:
        ValueError: malformed rounds (shapes, ranges, dtypes) or ``n_bins < 1``.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}.")
    c, n_acc = _check_rounds(confidences, accepted)
    gamma = c.shape[1]
    survival, labels = torch.cumprod(c, 1), survival_labels(n_acc, gamma)  # (N, γ) each
    positions = []
    for k in range(gamma):
        auc = roc_auc(survival[:, k], labels[:, k])
        positions.append({
            "position": k + 1,
            "survival_rate": labels[:, k].mean().item(),
            "ece": _ece_columns(survival[:, k : k + 1], labels[:, k], n_bins).item(),
            "brier": ((survival[:, k] - labels[:, k]) ** 2).mean().item(),
            "roc_auc": None if math.isnan(auc) else auc,
        })
    aucs = [p["roc_auc"] for p in positions if p["roc_auc"] is not None]
    return {
        "n_rounds": c.shape[0],
        "ece": sum(p["ece"] for p in positions) / gamma,
        "brier": sum(p["brier"] for p in positions) / gamma,
        "roc_auc": sum(aucs) / len(aucs) if aucs else None,
        "positions": positions,
    }

