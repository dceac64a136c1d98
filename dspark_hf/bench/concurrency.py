"""``dspark bench --concurrency 1,2,4,8``: many requests at once, by arm and concurrency R (issue 24; paper Figs. 7-8).

For every R, a closed loop (:func:`~dspark_hf.decoding.batch_generate.generate_concurrent`) serves ``2·R``
prompts with at most R in flight, greedy, through each arm:

* ``plain``: batched decoding without a drafter (the same loop, ``ℓ_r = 0``): the baseline;
* ``fixed``: every request verifies its γ drafts (load-independent);
* ``best_fixed``: fixed verification at each k of ``fixed_ks`` (e.g. 1, 2, 3, 5, 7), the fastest k at this R
  (aggregate tok/s; an oracle no fixed setting reaches across R: each R picks its own k);
* ``threshold``: the confident prefix (``c_k ≥ t``), load-independent too;
* ``scheduler``: Algorithm 1 across the requests on the step cost model, with the draft-or-not gate;
* ``async``: the §5.2 global search across the requests, with the gate.

Each arm runs once untimed first (warm-up; the scheduled modes load or profile their SPS curve there). Reported
per (arm, R): aggregate tok/s, per-user tok/s (median and p10 over requests: a request's tokens over its time in
flight), τ, the mean verification budget per request ``1 + ℓ̄``, verified-but-rejected drafts, the median absolute
error of the predicted step time, and greedy mismatches against ``plain``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

ARMS = ("plain", "fixed", "best_fixed", "threshold", "scheduler", "async")
FIXED_KS = (1, 2, 3, 5, 7)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run_arm(target, drafter, prompts: list[list[int]], concurrency: int, max_new_tokens: int, arm: str,
            gamma: int) -> tuple[dict, list[list[int]]]:
    """One timed closed loop of ``arm`` at ``concurrency`` (after an untimed warm-up); returns ``(row, outputs)``."""
    from ..decoding.batch_generate import generate_concurrent

    settings = {} if arm == "plain" else {"verification": arm, "block_size": gamma}
    model = None if arm == "plain" else drafter
    generate_concurrent(target, model, prompts[:concurrency], max_concurrency=concurrency, max_new_tokens=4,
                        **settings)
    start = time.perf_counter()
    outputs, stats = generate_concurrent(target, model, prompts, max_concurrency=concurrency,
                                         max_new_tokens=max_new_tokens, **settings)
    wall = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    per_user = [len(o) / s for o, s in zip(outputs, stats.request_s) if s > 0]
    steps = [s for s in stats.steps if not s.prefill]
    predicted = [abs(s.predicted_ms - s.step_ms) / s.step_ms for s in steps if s.predicted_ms > 0 and s.step_ms > 0]
    rounds = [r for row in stats.rows for r in row.rounds]
    row = {
        "arm": arm, "concurrency": concurrency, "requests": len(prompts), "tokens": tokens, "seconds": wall,
        "aggregate_tok_s": tokens / wall,
        "per_user_tok_s_median": statistics.median(per_user) if per_user else 0.0,
        "per_user_tok_s_p10": _quantile(per_user, 0.1),
        "tau": stats.tau, "verified_per_request": stats.mean_verified,
        "rejected_drafts": sum(r.scheduled - r.accepted for r in rounds),
        "drafting_steps": sum(1 for s in steps if s.drafted), "steps": len(steps),
        "step_ms_median": statistics.median(s.step_ms for s in steps) if steps else 0.0,
        "predicted_step_error_median": statistics.median(predicted) if predicted else None,
    }
    return row, outputs


def run_best_fixed(target, drafter, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
                   ks=FIXED_KS, known: dict | None = None) -> tuple[dict, list[list[int]]]:
    """Fixed verification at each ``k`` of ``ks`` (``known``: ``{k: (row, outputs)}`` already run); returns the
    fastest k's ``(row, outputs)``, its row renamed ``best_fixed`` with ``k`` and ``tok_s_by_k``."""
    runs = dict(known or {})
    for k in ks:
        if k not in runs:
            runs[k] = run_arm(target, drafter, prompts, concurrency, max_new_tokens, "fixed", k)
    best = max(ks, key=lambda k: runs[k][0]["aggregate_tok_s"])
    row, outputs = runs[best]
    row = {**row, "arm": "best_fixed", "k": best,
           "tok_s_by_k": {str(k): runs[k][0]["aggregate_tok_s"] for k in ks}}
    return row, outputs


def run_concurrency(target, drafter, prompts: list[list[int]], levels: list[int], max_new_tokens: int, gamma: int,
                    arms=ARMS, log=print, fixed_ks=FIXED_KS) -> dict:
    """Every arm at every concurrency level; ``2·R`` prompts per level (prompts repeat if there are fewer).

    Returns:
        ``{"rows": [...], "settings": {...}}`` with one row per (arm, R) as :func:`run_arm` makes it, plus
        ``mismatches`` (greedy outputs differing from ``plain``) and ``speed_vs_plain``; ``best_fixed`` rows add
        ``k`` and ``tok_s_by_k`` (:func:`run_best_fixed`; ``fixed_ks`` the k tried).

    Raises:
        ValueError: no prompts, a level below 1 or an unknown arm.
    """
    if not prompts:
        raise ValueError("the concurrency bench needs prompts.")
    if any(r < 1 for r in levels):
        raise ValueError(f"concurrency levels must be >= 1, got {levels}.")
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; choose from {ARMS}.")
    rows = []
    for concurrency in levels:
        batch = [prompts[i % len(prompts)] for i in range(2 * concurrency)]
        reference, fixed = None, {}
        for arm in arms:
            if arm == "best_fixed":
                row, outputs = run_best_fixed(target, drafter, batch, concurrency, max_new_tokens, fixed_ks, fixed)
            else:
                row, outputs = run_arm(target, drafter, batch, concurrency, max_new_tokens, arm, gamma)
            if arm == "fixed":
                fixed[gamma] = row, outputs
            if arm == "plain":
                reference, plain = outputs, row
            row["mismatches"] = sum(o != r for o, r in zip(outputs, reference)) if reference is not None else None
            row["speed_vs_plain"] = row["aggregate_tok_s"] / plain["aggregate_tok_s"] if reference is not None else None
            rows.append(row)
            log(f"R={concurrency} {arm:10s} {row['aggregate_tok_s']:6.1f} tok/s aggregate, "
                f"{row['per_user_tok_s_median']:5.1f} per user, 1+ℓ̄ {row['verified_per_request']:.2f}, "
                f"τ {row['tau']:.2f}, mismatches {row['mismatches']}")
    return {"rows": rows, "settings": {"levels": list(levels), "max_new_tokens": max_new_tokens, "gamma": gamma,
                                       "arms": list(arms), "fixed_ks": list(fixed_ks), "prompts_per_level": "2·R"}}


def markdown(result: dict) -> str:
    """The table of :func:`run_concurrency` as Markdown."""
    lines = ["| R | arm | aggregate tok/s | per-user median / p10 | × plain | 1+ℓ̄ | τ | rejected | drafting steps "
             "| step ms | pred. error | mismatches |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        error = f"{100 * r['predicted_step_error_median']:.0f} %" if r["predicted_step_error_median"] is not None else "—"
        arm = f"best_fixed (k = {r['k']})" if r["arm"] == "best_fixed" else r["arm"]
        lines.append(f"| {r['concurrency']} | {arm} | {r['aggregate_tok_s']:.1f} | "
                     f"{r['per_user_tok_s_median']:.1f} / {r['per_user_tok_s_p10']:.1f} | {r['speed_vs_plain']:.2f} | "
                     f"{r['verified_per_request']:.2f} | {r['tau']:.2f} | {r['rejected_drafts']} | "
                     f"{r['drafting_steps']}/{r['steps']} | {r['step_ms_median']:.0f} | {error} | {r['mismatches']} |")
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: str | os.PathLike) -> list[Path]:
    """``concurrency.json``, ``concurrency.md`` and two plots (Fig. 7-style frontier: aggregate against per-user
    tok/s; Fig. 8-style budget: ``1 + ℓ̄`` against R) in ``out_dir``; returns the paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "concurrency.json", out / "concurrency.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths[1].write_text(markdown(result))
    for name, x, y, xlabel, ylabel in (
        ("concurrency_frontier.png", "per_user_tok_s_median", "aggregate_tok_s", "per-user tok/s (median)",
         "aggregate tok/s"),
        ("concurrency_budget.png", "concurrency", "verified_per_request", "concurrent requests R",
         "verified tokens per request and step (1 + ℓ̄)"),
    ):
        figure = Figure(figsize=(5.5, 4))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        for arm in result["settings"]["arms"]:
            rows = [r for r in result["rows"] if r["arm"] == arm]
            axes.plot([r[x] for r in rows], [r[y] for r in rows], marker="o", label=arm)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
        if x == "concurrency":
            axes.set_xscale("log", base=2)
        axes.legend()
        figure.tight_layout()
        figure.savefig(out / name, dpi=110)
        paths.append(out / name)
    return paths
