"""``dspark bench --concurrency 1,2,4,8``: many requests at once, by arm and concurrency R (issue 24; paper Figs. 7-8).

For every R, a closed loop (:func:`~dspark_hf.decoding.batch_generate.generate_concurrent`) serves ``2·R``
prompts with at most R in flight, greedy, through each arm:

* ``plain``: batched decoding without a drafter (the same loop, ``ℓ_r = 0``): the baseline;
* ``fixed``: every request verifies its γ drafts (load-independent);
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

ARMS = ("plain", "fixed", "threshold", "scheduler", "async")


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


def run_concurrency(target, drafter, prompts: list[list[int]], levels: list[int], max_new_tokens: int, gamma: int,
                    arms=ARMS, log=print) -> dict:
    """Every arm at every concurrency level; ``2·R`` prompts per level (prompts repeat if there are fewer).

    Returns:
        ``{"rows": [...], "settings": {...}}`` with one row per (arm, R) as :func:`run_arm` makes it, plus
        ``mismatches`` (greedy outputs differing from ``plain``) and ``speed_vs_plain``.

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
        reference = None
        for arm in arms:
            row, outputs = run_arm(target, drafter, batch, concurrency, max_new_tokens, arm, gamma)
            if arm == "plain":
                reference, plain = outputs, row
            row["mismatches"] = sum(o != r for o, r in zip(outputs, reference)) if reference is not None else None
            row["speed_vs_plain"] = row["aggregate_tok_s"] / plain["aggregate_tok_s"] if reference is not None else None
            rows.append(row)
            log(f"R={concurrency} {arm:9s} {row['aggregate_tok_s']:6.1f} tok/s aggregate, "
                f"{row['per_user_tok_s_median']:5.1f} per user, 1+ℓ̄ {row['verified_per_request']:.2f}, "
                f"τ {row['tau']:.2f}, mismatches {row['mismatches']}")
    return {"rows": rows, "settings": {"levels": list(levels), "max_new_tokens": max_new_tokens, "gamma": gamma,
                                       "arms": list(arms), "prompts_per_level": "2·R"}}


def markdown(result: dict) -> str:
    """The table of :func:`run_concurrency` as Markdown."""
    lines = ["| R | arm | aggregate tok/s | per-user median / p10 | × plain | 1+ℓ̄ | τ | rejected | drafting steps "
             "| step ms | pred. error | mismatches |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        error = f"{100 * r['predicted_step_error_median']:.0f} %" if r["predicted_step_error_median"] is not None else "—"
        lines.append(f"| {r['concurrency']} | {r['arm']} | {r['aggregate_tok_s']:.1f} | "
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
