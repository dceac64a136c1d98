"""Pure functions over recorded rounds: the static-threshold sweep replayed offline (paper Fig. 5), full rounds,
the calibration summary, and small statistics. τ and conditional acceptance are :mod:`dspark_hf.metrics`."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

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


def prompt_floor(plains, runs) -> dict | None:
    """The floor of one prompt (issue #28): the rounds of ``runs`` that verified the target's token alone (nothing
    drafted, the drafter not run) against the decoding steps of ``plains`` on the same prompt, taken apart, pooled
    over the runs given (the floor pass repeats each prompt; the wall-clock pass gives one run of each).

    Args:
        plains: the prompt's plain ``generate`` :class:`~dspark_hf.evaluation.runs.Run` s.
        runs: DSpark runs of the same prompt (``run.stats`` set, one forward per round after the prefill).

    Returns:
        ``None`` when no run had such a round (runs whose forwards do not line up with their rounds are left out),
        else medians in ms over the floor rounds of all runs (each run's last round, whose wall clock is not
        recorded, left out): ``floor_rounds``, ``round_ms`` (a round's whole wall clock), ``forward_ms`` (the
        target's forward, hidden states captured), ``plan_ms`` (the lookup planner), ``bookkeeping_ms`` (features
        collected, costs learnt, online updates), ``loop_ms`` (the rest: transformers' assisted loop: attention mask
        and inputs, acceptance, the cache crop, stopping); over the steps of all plain runs, ``plain_step_ms``,
        ``plain_forward_ms`` and ``plain_loop_ms`` (step minus forward); ``ratio`` = ``round_ms / plain_step_ms``;
        ``context_ms_per_token`` (what the drafter's context extension costs per position, paid in the next drafted
        round: every floor round leaves one position to append; each run's first extension, over the prompt, left
        out; ``None`` when no run drafted twice); and the prefill (medians over runs): ``prefill_ms`` (the
        target's) and ``prefill_extension_ms`` (the drafter's context extension over the prompt's positions, in
        the first round that drafts; ``None`` when no run drafted).
    """
    steps = [ms for plain in plains for ms in plain.step_ms]
    plain_forwards = [ms for plain in plains for ms in plain.forward_ms[1:]]
    parts = {"round_ms": [], "forward_ms": [], "plan_ms": [], "bookkeeping_ms": [], "loop_ms": []}
    later, prefills, first_extensions = [], [], []
    for run in runs:
        rounds, forwards = run.stats.rounds, run.forward_ms[1:]
        if len(forwards) != len(rounds):
            continue
        for r, forward in zip(rounds[:-1], forwards):
            if r.drafted == 0:
                parts["round_ms"].append(r.round_ms)
                parts["forward_ms"].append(forward)
                parts["plan_ms"].append(r.plan_ms)
                parts["bookkeeping_ms"].append(r.bookkeeping_ms)
                parts["loop_ms"].append(r.round_ms - forward - r.plan_ms - r.bookkeeping_ms)
        extensions = [r for r in rounds if r.context_tokens > 0]
        later += extensions[1:]
        first_extensions += [extensions[0].context_ms] if extensions else []
        prefills += run.forward_ms[:1]
    if not parts["round_ms"] or not steps:
        return None
    out = {"floor_rounds": len(parts["round_ms"]), **{k: median(v) for k, v in parts.items()}}
    plain_step, plain_forward = median(steps), median(plain_forwards)
    out.update(
        plain_step_ms=plain_step,
        plain_forward_ms=plain_forward,
        plain_loop_ms=plain_step - plain_forward,
        ratio=out["round_ms"] / plain_step,
        context_ms_per_token=(sum(r.context_ms for r in later) / sum(r.context_tokens for r in later)
                              if later else None),
        prefill_ms=median(prefills),
        prefill_extension_ms=median(first_extensions),
    )
    return out


def floor_summary(per_prompt: Mapping[str, dict | None]) -> dict | None:
    """Medians over prompts of :func:`prompt_floor`'s values (``{prompt id: its floor}``; ``floor_rounds`` summed),
    the worst ``ratio`` as ``worst_ratio`` on ``worst_prompt``, the number of ``prompts`` that had floor rounds and
    each one's ratio (``per_prompt``); ``None`` when none had."""
    rows = {i: p for i, p in per_prompt.items() if p is not None}
    if not rows:
        return None
    first = next(iter(rows.values()))
    out = {k: median([r[k] for r in rows.values()]) for k in first if k != "floor_rounds"}
    worst = max(rows, key=lambda i: rows[i]["ratio"])
    out.update(prompts=len(rows), floor_rounds=sum(r["floor_rounds"] for r in rows.values()),
               worst_ratio=rows[worst]["ratio"], worst_prompt=worst,
               per_prompt={i: r["ratio"] for i, r in rows.items()})
    return out
