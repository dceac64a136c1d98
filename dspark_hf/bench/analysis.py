"""Pure functions over recorded rounds: the static-threshold sweep replayed offline (paper Fig. 5), full rounds,
the calibration summary, and small statistics. τ and conditional acceptance are :mod:`dspark_hf.metrics`."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from ..decoding.scheduler import threshold_prefix


def threshold_sweep(confidences: Sequence[Sequence[float]], accepted: Sequence[int], thresholds: Sequence[float],
                    step_seconds: Sequence[float] | None = None) -> list[dict]:
    """Static-threshold verification replayed on fixed-length rounds (paper Fig. 5).

    A round verified with prefix ℓ accepts ``min(n, ℓ)`` drafts (acceptance is a prefix; exact for greedy
    decoding, the coupled estimate for sampling) and rejects ``ℓ - min(n, ℓ)``. Threshold 0 is fixed
    verification.

    Args:
        confidences: raw ``c_k`` per round, ``N`` rows of γ values.
        accepted: drafts accepted per round under fixed verification, ``N`` values in ``0..γ``.
        thresholds: the thresholds ``t`` to replay.
        step_seconds: optional ``step_seconds[ℓ]`` = seconds of one round that verifies ℓ drafts (draft
            cost + ``1 / SPS(ℓ + 1)``), ``ℓ = 0..γ``; adds ``modelled_tokens_per_s``.

    Returns:
        One dict per threshold: ``threshold``, ``rounds``, ``accepted_per_step`` (``mean(min(n, ℓ) + 1)``,
        bonus included, = τ), ``rejected_per_step``, ``verified_per_step`` (mean ℓ), ``acceptance_rate``
        (``Σ(min(n, ℓ) + 1) / Σ(ℓ + 1)``, bonus included as in the paper), ``draft_acceptance_rate``
        (``Σ min(n, ℓ) / Σ ℓ``, ``None`` when nothing is verified) and optionally ``modelled_tokens_per_s``.
    """
    if len(confidences) != len(accepted):
        raise ValueError(f"{len(confidences)} confidence rows but {len(accepted)} accepted counts")
    n_rounds, rows = len(accepted), []
    for t in thresholds:
        lengths = [threshold_prefix(c, t) for c, n in zip(confidences, accepted)]  # the mode's own rule
        kept = [min(n, length) for n, length in zip(accepted, lengths)]
        row = dict(
            threshold=t,
            rounds=n_rounds,
            accepted_per_step=sum(k + 1 for k in kept) / n_rounds if n_rounds else None,
            rejected_per_step=sum(ell - k for ell, k in zip(lengths, kept)) / n_rounds if n_rounds else None,
            verified_per_step=sum(lengths) / n_rounds if n_rounds else None,
            acceptance_rate=sum(k + 1 for k in kept) / (sum(lengths) + n_rounds) if n_rounds else None,
            draft_acceptance_rate=sum(kept) / sum(lengths) if sum(lengths) else None,
        )
        if step_seconds is not None and n_rounds:
            row["modelled_tokens_per_s"] = sum(k + 1 for k in kept) / sum(step_seconds[ell] for ell in lengths)
        rows.append(row)
    return rows


def best_threshold(sweep: Sequence[dict]) -> float | None:
    """The threshold with the highest ``modelled_tokens_per_s`` (the lowest one on ties); ``None`` if unmodelled."""
    scored = [r for r in sweep if r.get("modelled_tokens_per_s") is not None]
    return max(scored, key=lambda r: (r["modelled_tokens_per_s"], -r["threshold"]))["threshold"] if scored else None


def full_rounds(stats_list, gamma: int) -> tuple[list[int], list[list[float]]]:
    """Rounds that verified all γ drafts, pooled over generations: ``(accepted, confidences)``.

    The last round of every generation is dropped (EOS or the token budget may cut its acceptance short),
    as :meth:`dspark_hf.GenerationStats.full_rounds` does; ``confidences`` is empty for drafters without a
    confidence head.
    """
    accepted, confidences = [], []
    for stats in stats_list:
        for r in stats.rounds[:-1]:
            if r.is_full(gamma):
                accepted.append(r.accepted)
                if r.confidences:
                    confidences.append(list(r.confidences))
    return accepted, confidences


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of two sequences (a length difference counts), ``None`` if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def confidence_summary(confidences: Sequence[Sequence[float]], accepted: Sequence[int], calibration,
                       n_bins: int = 15) -> dict | None:
    """ECE of ``a_k`` before / after STS and ROC-AUC of ``c_k`` per position (paper §4, Fig. 6).

    A thin view of :meth:`dspark_hf.SequentialTemperatureScaling.report`; ``None`` without rounds.
    """
    if not confidences:
        return None
    report = calibration.report(torch.tensor(confidences, dtype=torch.float64), torch.tensor(accepted), n_bins)
    keys = ("position", "temperature", "survival_rate", "ece_before", "ece_after", "roc_auc", "n_conditional")
    return {
        "rounds": report["n_rounds"],
        "mean_ece_before": report["mean_ece_before"],
        "mean_ece_after": report["mean_ece_after"],
        "positions": [{k: p[k] for k in keys} for p in report["positions"]],
    }
