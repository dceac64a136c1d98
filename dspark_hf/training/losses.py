"""The training loss of paper eqs. 8-12 and the teacher-forced acceptance it is read with; pure functions of tensors.

Shape symbols: ``S`` sequences, ``A`` blocks per sequence, ``γ`` block size, ``V'`` draft vocabulary, ``K`` the
target's stored top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_weights(gamma: int, decay: float | None = 4.0) -> torch.Tensor:
    """``w_k = exp(-(k-1)/λ)`` for k = 1..γ (paper §3.3). Shape ``[γ]``.

    ``λ = decay``: 4 by default, as the reference trainers (DeepSpec, speculators); ``None`` gives the
    paper's ``λ = γ``.
    """
    lam = float(decay or gamma)
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / lam)


def tv_distance(draft_probs: torch.Tensor, target_ids: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """``||p_d - p_t||_1`` with ``p_t`` known only on its top-K support (paper eq. 10).

    Args:
        draft_probs: ``[..., V']`` draft distribution over the draft vocabulary.
        target_ids: ``[..., K]`` draft-vocabulary rows of the target's top-K tokens; ``-1`` for a
            token outside the draft vocabulary (the drafter gives it probability 0).
        target_probs: ``[..., K]`` their target probabilities (summing to ``<= 1``).

    Returns:
        ``[...]``: exact L1 on the top-K support, plus ``|rest_d - rest_t|`` for the remaining mass
        (a lower bound of the full L1 that is exact when ``p_t`` is fully inside its top-K).

    Decision (issue #11): the references (DeepSpec, speculators) take the L1 over the FULL target
    distribution, computed on the fly from the target's logits. dspark-hf trains on cached features
    and caches only the target's top-32 distribution (a full ``[V]`` row per token would be ~200x
    larger), so this stays top-K + bound. For a peaked target (top-32 holding almost all the mass)
    the two agree; otherwise this under-estimates the L1 by at most the draft mass spread over the
    rest, and c*_k (eq. 8) is biased upward by at most half of that.
    """
    inside = target_ids >= 0
    pd_at = torch.gather(draft_probs, -1, target_ids.clamp(min=0)) * inside
    on_support = ((pd_at - target_probs).abs() * inside + target_probs * ~inside).sum(-1)
    rest_d = 1 - pd_at.sum(-1)
    rest_t = 1 - target_probs.sum(-1)
    return on_support + (rest_d - rest_t).abs()


def dspark_loss(logits, confidence_logits, labels, target_ids, target_probs, valid, weights, loss_weights):
    """Paper eq. 12: ``α_ce L_ce + α_tv L_tv + α_conf L_conf``, each position-weighted by ``w_k``.

    Each term is normalised per weighted token, as the reference trainers: ``Σ w_k ℓ_k / Σ w_k`` over
    the valid positions (a position whose label is outside the draft vocabulary counts in the
    denominator with zero cross-entropy).

    Args:
        logits: ``[N, γ, V']`` draft logits ``U + B`` (teacher-forced sequential head).
        confidence_logits: ``[N, γ]`` or ``None``.
        labels: ``[N, γ]`` ground-truth draft-vocab rows (``-1``: outside the draft vocabulary).
        target_ids, target_probs: ``[N, γ, K]`` the target's top-K distribution (see :func:`tv_distance`).
        valid: ``[N, γ]`` bool, positions that exist in the sequence.
        weights: ``[γ]`` position weights.

    Returns:
        ``(loss, parts)`` where ``parts`` holds the detached terms and ``accept`` ``[γ]`` = mean of
        ``c*_k = 1 - ½||p_d - p_t||_1`` per position (eq. 8).
    """
    log_p = logits.float().log_softmax(-1)
    probs = log_p.exp()
    w = weights.to(logits.device)[None] * valid  # [N, γ]
    total = w.sum().clamp(min=1e-12)  # Σ w over valid positions: per weighted token
    ce_valid = valid & (labels >= 0)
    ce = -torch.gather(log_p, -1, labels.clamp(min=0)[..., None])[..., 0] * ce_valid
    tv = tv_distance(probs, target_ids, target_probs)
    accept = (1 - 0.5 * tv).clamp(0, 1).detach()  # c*_k, eq. 8
    parts = {"ce": (ce * w).sum() / total, "tv": (tv * w).sum() / total}
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
        parts["conf"] = (bce * w).sum() / total
    loss = sum(loss_weights[k] * v for k, v in parts.items())
    per_position = (accept * valid).sum(0) / valid.sum(0).clamp(min=1)
    return loss, {**{k: v.detach() for k, v in parts.items()}, "accept": per_position}


def greedy_survival(logits: torch.Tensor, target_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Teacher-forced greedy prefix survival: draft ``k`` survives greedy verification when its argmax and
    every earlier one equal the target's top-1 token (the greedy ``n ≥ k`` event of the bench's τ).

    Args:
        logits: ``[N, γ, V']`` draft logits; target_ids: ``[N, γ, K]`` draft-vocab rows of the target's
            top-K (row 0 = its argmax; ``-1`` outside the draft vocabulary, never matched); valid: ``[N, γ]``.

    Returns:
        ``[γ]``: P(n ≥ k) over blocks whose position ``k`` exists.
    """
    hit = (logits.argmax(-1) == target_ids[..., 0]) & valid
    survive = hit.long().cumprod(-1).float()
    return (survive * valid).sum(0) / valid.sum(0).clamp(min=1)


def expected_tau(accept: torch.Tensor) -> float:
    """τ estimate from per-position acceptance ``[γ]``: ``1 + Σ_k Π_{i<=k} accept_i``."""
    return 1.0 + float(torch.cumprod(accept, 0).sum())
