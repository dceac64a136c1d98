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

Each closed loop runs once untimed first (warm-up; the scheduled modes load or profile their SPS curve there);
the first time a loop runs at an R its warm-up serves R prompts to full length, so the draft-or-not gate has
learnt R's step costs (kept with the target across loops) before a timed loop: with a 4-token warm-up the first
timed scheduler loop at R = 8 (2 threads) ran 12 drafting steps of 126 where later loops ran 2, at 0.89× plain.
At each R the arms run :data:`REPEATS` times, interleaved (the order reversed every other time), and each arm
reports its fastest run against plain's fastest: on a shared machine other load only slows runs down, and a
baseline measured once, first, moved by 12 % between two runs. On a machine whose speed drifts from minute to
minute even that moves (the 2-core EPYC: the same arm 0.87× then 1.02-1.18× plain), so the ``paired`` protocol
(:func:`schedule`) runs plain before every other closed loop and once at the end, the others rotated, and reports
each arm's median ratio to the plain runs just before and after it (:func:`adjacent_ratios`), with its range. Even
paired loops ~22 s apart differ by the machine's drift (R = 8, 2 threads: 0.89-1.04× plain); the ``lockstep``
protocol (:func:`lockstep_pair`) runs each loop step by step in turn with a plain loop of its own
(:mod:`~dspark_hf.bench.lockstep`), each timed on its own steps, and reports the median ratio and range over those
pairs. Reported per (arm, R): aggregate tok/s, per-user tok/s (median and p10 over requests: a request's tokens over its
time in flight), τ, the mean verification budget per request ``1 + ℓ̄``, verified-but-rejected drafts, the median
absolute error of the predicted step time, and greedy mismatches against ``plain``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from ..evaluation.tables import counted

ARMS = ("plain", "fixed", "best_fixed", "threshold", "scheduler", "async")
FIXED_KS = (1, 2, 3, 5, 7)
REPEATS = 2  # closed loops per arm and R, interleaved with the other arms' (plain before and after them)
PLAIN = ("plain", 0)  # plain batched decoding's closed loop, as (mode, γ)
WARM_UP_TOKENS = 4  # new tokens per request of a warm-up after a loop's first at an R (the first runs to full length)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run_arm(target, drafter, prompts: list[list[int]], concurrency: int, max_new_tokens: int, arm: str,
            gamma: int, warm_up_tokens: int = WARM_UP_TOKENS) -> tuple[dict, list[list[int]]]:
    """One timed closed loop of ``arm`` at ``concurrency`` after an untimed warm-up (:func:`warm_up`); returns
    ``(row, outputs)`` as :func:`closed_loop`."""
    warm_up(target, drafter, prompts, concurrency, warm_up_tokens, arm, gamma)
    return closed_loop(target, drafter, prompts, concurrency, max_new_tokens, arm, gamma)


def _loop_settings(drafter, arm: str, gamma: int) -> tuple:
    """``(drafter or None, generate_concurrent settings)`` of an arm's closed loop."""
    return (None, {}) if arm == "plain" else (drafter, {"verification": arm, "block_size": gamma})


def warm_up(target, drafter, prompts: list[list[int]], concurrency: int, tokens: int, arm: str, gamma: int) -> None:
    """An untimed closed loop of ``arm``: the first ``concurrency`` prompts, ``tokens`` new tokens each."""
    from ..decoding.batch_generate import generate_concurrent

    model, settings = _loop_settings(drafter, arm, gamma)
    generate_concurrent(target, model, prompts[:concurrency], max_concurrency=concurrency, max_new_tokens=tokens,
                        **settings)


def closed_loop(target, drafter, prompts: list[list[int]], concurrency: int, max_new_tokens: int, arm: str,
                gamma: int) -> tuple[dict, list[list[int]]]:
    """One timed closed loop of ``arm`` at ``concurrency`` (no warm-up); returns ``(row, outputs)``: the row's
    times are ``time.perf_counter`` seconds, the arm's own in a lockstep (:mod:`~dspark_hf.bench.lockstep`)."""
    from ..decoding.batch_generate import generate_concurrent

    model, settings = _loop_settings(drafter, arm, gamma)
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


def _runs_of(arms, gamma: int, fixed_ks) -> list[tuple[str, int]]:
    """The closed loops one repetition runs, as ``(mode, γ)``: ``best_fixed`` is fixed verification at each k of
    ``fixed_ks`` (fixed γ's loop counted once when the ``fixed`` arm runs it too), ``plain`` has γ = 0."""
    runs = []
    for arm in arms:
        if arm == "best_fixed":
            runs += [("fixed", k) for k in fixed_ks if k != gamma or "fixed" not in arms]
        else:
            runs.append((arm, 0 if arm == "plain" else gamma))
    return runs


def check_arms(arms, paired: bool = False) -> None:
    """Raises ``ValueError`` for an arm outside :data:`ARMS`, and with ``paired`` for arms without plain or without
    another arm (the paired and lockstep protocols compare the others with plain)."""
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; choose from {ARMS}.")
    if paired and ("plain" not in arms or len(set(arms)) < 2):
        raise ValueError(f"the paired or lockstep protocol needs plain and another arm, got {list(arms)}.")


def schedule(loops: list[tuple[str, int]], repeats: int, paired: bool = False) -> list[tuple[int, tuple[str, int]]]:
    """The closed loops of one R in the order they run, as ``(repetition, (mode, γ))``.

    By default every loop once per repetition, every other repetition in reverse order (plain first, then last).
    ``paired``: :data:`PLAIN` before each other loop and once at the end (``P a P b P a ... P``), the other loops
    rotated by one each repetition (``a b``, ``b a``, ...), so every run of an arm has a plain run just before and
    just after it, whatever the machine's speed did in between (about twice the closed loops of the default; the
    arms :func:`check_arms` accepts).
    """
    if not paired:
        return [(i, loop) for i in range(repeats) for loop in (loops if i % 2 == 0 else loops[::-1])]
    others = [loop for loop in loops if loop != PLAIN]
    order = []
    for i in range(repeats):
        shift = i % len(others)
        for loop in others[shift:] + others[:shift]:
            order += [(i, PLAIN), (i, loop)]
    return order + [(repeats - 1, PLAIN)]


def adjacent_ratios(timeline: list[tuple[tuple[str, int], float]]) -> dict[tuple[str, int], list[float]]:
    """Each run's value over the mean of the :data:`PLAIN` runs adjacent to it in time (the nearest one before and
    the nearest one after; only one at an end), by loop in the order they ran; plain itself is left out.

    Args:
        timeline: ``(loop, value)`` of every run at one R in the order they ran (value: e.g. aggregate tok/s).
    """
    plain = [i for i, (loop, _) in enumerate(timeline) if loop == PLAIN]
    ratios = {}
    for i, (loop, value) in enumerate(timeline):
        near = [j for j in plain if j < i][-1:] + [j for j in plain if j > i][:1]
        if loop != PLAIN and near:
            ratios.setdefault(loop, []).append(value / statistics.mean(timeline[j][1] for j in near))
    return ratios


def repeat_note(distinct: int, levels: list[int]) -> str | None:
    """The note for the levels whose closed loop serves more requests (``2·R``) than there are ``distinct`` prompts,
    which then repeat in turn; ``None`` when every level has enough."""
    short = [r for r in levels if 2 * r > distinct]
    if not short:
        return None
    return (f"R = {', '.join(map(str, short))}: the closed loop serves 2·R requests from "
            f"{counted(distinct, 'distinct prompt')}, taken in turn and repeated; a larger --limit (prompts per suite) "
            f"gives more distinct ones ({2 * max(short)} for R = {max(short)}).")


def run_concurrency(target, drafter, prompts: list[list[int]], levels: list[int], max_new_tokens: int, gamma: int,
                    arms=ARMS, log=print, fixed_ks=FIXED_KS, repeats: int = REPEATS, paired: bool = False,
                    lockstep: bool = False, notes: Sequence[str] = ()) -> dict:
    """Every arm at every concurrency level; ``2·R`` prompts per level (with fewer prompts they repeat in turn:
    request i gets ``prompts[i % len(prompts)]``, and :func:`repeat_note` says so). The caller's ``notes`` (the
    command's: a quick run, drafters or prompts skipped) and that one are logged first and kept in the result.

    At each R the arms' closed loops run ``repeats`` times, interleaved, every other repetition in reverse order
    (plain first, then last, ...), so the baseline sees the same machine as the drafting arms; each arm's row is
    its fastest repetition (other load on the machine only slows a run down), ``speed_vs_plain`` its aggregate
    tok/s over plain's fastest, ``speed_vs_plain_paired`` the same per repetition; a loop's first run at an R warms
    up to full length (``max_new_tokens``, the module docstring), later ones with :data:`WARM_UP_TOKENS`.
    ``paired``: the runs follow :func:`schedule`'s paired order instead, ``speed_vs_plain_paired`` is each run over
    the plain runs adjacent to it (:func:`adjacent_ratios`), and ``paired_median`` / ``paired_range``
    (``[min, max]``) summarise those ratios, ``paired_median_per_user`` the same ratios of the per-user median tok/s
    (``None`` without ``paired``).
    ``lockstep``: each run of a loop other than plain runs in lockstep with a plain closed loop of its own
    (:func:`lockstep_pair`, the loops of :func:`schedule`'s paired order with plain left out, the first turn
    alternating between plain and the other), ``speed_vs_plain_paired`` is each run over its plain partner, and the
    ``paired_*`` fields summarise those ratios.

    Returns:
        ``{"rows": [...], "settings": {...}, "notes": [...]}`` (``settings["distinct_prompts"]``: how many different
        prompts the requests got) with one row per (arm, R) as :func:`run_arm` makes it, plus
        ``tok_s_runs`` and ``drafting_steps_runs`` (aggregate tok/s and drafting steps of each repetition),
        ``speed_vs_plain``, ``speed_vs_plain_paired`` and ``mismatches`` (greedy outputs of any repetition differing
        from ``plain``'s); ``best_fixed`` rows (the fastest fixed k at this R, ``fixed_ks`` the k tried) add ``k``
        and ``tok_s_by_k``.

    Raises:
        ValueError: no prompts, a level below 1, an unknown arm, ``repeats < 1``, ``paired`` or ``lockstep``
            without plain and another arm, or both.
    """
    if not prompts:
        raise ValueError("the concurrency bench needs prompts.")
    if any(r < 1 for r in levels):
        raise ValueError(f"concurrency levels must be >= 1, got {levels}.")
    if paired and lockstep:
        raise ValueError("choose the paired protocol or lockstep, not both.")
    check_arms(arms, paired or lockstep)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    rows, loops = [], _runs_of(arms, gamma, fixed_ks)
    order = schedule(loops, repeats, paired or lockstep)
    distinct = len({tuple(p) for p in prompts})
    notes = [*notes, *filter(None, [repeat_note(distinct, levels)])]
    for note in notes:
        log(note)
    for concurrency in levels:
        batch = [prompts[i % len(prompts)] for i in range(2 * concurrency)]
        runs = {loop: [] for loop in loops}  # (mode, γ) -> [(row, outputs) per run]
        timeline = []  # (loop, row) in the order they ran
        pairs = {"aggregate_tok_s": {}, "per_user_tok_s_median": {}}  # lockstep: loop -> [ratio to its partner]
        for repetition, (mode, k) in order:
            if lockstep and (mode, k) == PLAIN:
                continue  # plain runs as every other loop's partner
            warm_up = WARM_UP_TOKENS if runs[mode, k] else max_new_tokens  # a loop's first run at R: a full warm-up
            if lockstep:
                first = len(runs[PLAIN]) % 2  # plain, then the other loop, takes the first turn
                (plain_row, plain_outputs), (row, outputs) = lockstep_pair(
                    target, drafter, batch, concurrency, max_new_tokens, (mode, k),
                    WARM_UP_TOKENS if runs[PLAIN] else max_new_tokens, warm_up, first)
                runs[PLAIN].append((plain_row, plain_outputs))
                for key, ratios in pairs.items():
                    ratios.setdefault((mode, k), []).append(row[key] / plain_row[key])
            else:
                row, outputs = run_arm(target, drafter, batch, concurrency, max_new_tokens, mode, k, warm_up)
            runs[mode, k].append((row, outputs))
            timeline.append(((mode, k), row))
            log(f"R={concurrency} run {repetition + 1}/{repeats} {mode}{f' k={k}' if mode == 'fixed' else ''}: "
                f"{row['aggregate_tok_s']:.1f} tok/s, {row['drafting_steps']}/{row['steps']} drafting steps"
                + (f"; in lockstep with plain {plain_row['aggregate_tok_s']:.1f} tok/s, "
                   f"× {pairs['aggregate_tok_s'][mode, k][-1]:.3f}" if lockstep else ""))
        adjacent = pairs if lockstep else {key: adjacent_ratios([(loop, row[key]) for loop, row in timeline])
                                           for key in ("aggregate_tok_s", "per_user_tok_s_median")} if paired else None
        fastest = {loop: max(done, key=lambda run: run[0]["aggregate_tok_s"]) for loop, done in runs.items()}
        plain_runs = runs.get(PLAIN)
        for arm in arms:
            keys = [("fixed", k) for k in fixed_ks] if arm == "best_fixed" else [(arm, 0 if arm == "plain" else gamma)]
            best = max(keys, key=lambda loop: fastest[loop][0]["aggregate_tok_s"])
            row = {**fastest[best][0], "arm": arm, "tok_s_runs": [r["aggregate_tok_s"] for r, _ in runs[best]],
                   "drafting_steps_runs": [r["drafting_steps"] for r, _ in runs[best]]}
            if arm == "best_fixed":
                row.update(k=best[1], tok_s_by_k={str(k): fastest["fixed", k][0]["aggregate_tok_s"] for k in fixed_ks})
            ratios = adjacent["aggregate_tok_s"].get(best) if adjacent else None
            row.update(paired_median=statistics.median(ratios) if ratios else None,
                       paired_range=[min(ratios), max(ratios)] if ratios else None,
                       paired_median_per_user=statistics.median(adjacent["per_user_tok_s_median"][best])
                       if ratios else None)
            if plain_runs is None:
                row.update(mismatches=None, speed_vs_plain=None, speed_vs_plain_paired=None)
            else:
                reference = fastest[PLAIN]
                row["mismatches"] = sum(o != r for _, outputs in runs[best] for o, r in zip(outputs, reference[1]))
                row["speed_vs_plain"] = row["aggregate_tok_s"] / reference[0]["aggregate_tok_s"]
                row["speed_vs_plain_paired"] = ratios if adjacent else [a / p for a, p in zip(row["tok_s_runs"], (
                    r["aggregate_tok_s"] for r, _ in plain_runs))]
            rows.append(row)
            log(f"R={concurrency} {arm:10s} {row['aggregate_tok_s']:6.1f} tok/s aggregate (fastest of {repeats}), "
                f"{row['per_user_tok_s_median']:5.1f} per user, 1+ℓ̄ {row['verified_per_request']:.2f}, "
                f"τ {row['tau']:.2f}, mismatches {row['mismatches']}"
                + (f", × {'lockstep' if lockstep else 'adjacent'} plain median {row['paired_median']:.3f}"
                   if ratios else ""))
    return {"rows": rows, "notes": notes,
            "settings": {"levels": list(levels), "max_new_tokens": max_new_tokens, "gamma": gamma, "arms": list(arms),
                         "fixed_ks": list(fixed_ks), "prompts_per_level": "2·R", "distinct_prompts": distinct,
                         "repeats": repeats,
                         "protocol": "lockstep" if lockstep else "paired" if paired else "interleaved",
                         "reported": "fastest repetition per arm, interleaved"
                         + ("; median ratio to the adjacent plain runs" if paired else "")
                         + ("; median ratio to its plain partner in lockstep" if lockstep else "")}}


def lockstep_pair(target, drafter, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
                  loop: tuple[str, int], plain_warm_up: int, warm_up_tokens: int, first: int) -> tuple[tuple, tuple]:
    """Plain batched decoding's closed loop and ``loop``'s (``(mode, γ)``) in lockstep
    (:func:`~dspark_hf.bench.lockstep.run_lockstep`: one step of each in turn, each timed on its own turns), each
    after its untimed warm-up (:func:`warm_up`, ``plain_warm_up`` and ``warm_up_tokens`` new tokens per request).

    Ragged attention is switched on around both loops (each loop's own switch then leaves it alone), so the loop
    that finishes first does not switch it off under the other.

    Returns:
        ``((plain row, outputs), (loop's row, outputs))`` as :func:`closed_loop`.
    """
    from ..runtime.ragged import ragged_attention
    from .lockstep import run_lockstep

    mode, gamma = loop
    warm_up(target, drafter, prompts, concurrency, plain_warm_up, PLAIN[0], PLAIN[1])
    warm_up(target, drafter, prompts, concurrency, warm_up_tokens, mode, gamma)
    with ragged_attention(target):
        result = run_lockstep(target, [
            lambda: closed_loop(target, drafter, prompts, concurrency, max_new_tokens, *PLAIN),
            lambda: closed_loop(target, drafter, prompts, concurrency, max_new_tokens, mode, gamma)], first=first)
    return result.values[0], result.values[1]


LEGEND = (
    "Each row is one arm at one concurrency R: a closed loop serving 2·R prompts with at most R in flight, greedy, "
    "prefill included, each after an untimed warm-up (R prompts; to full length before an arm's first run at an R, "
    "so the draft-or-not gate has learnt R's step costs); every arm ran {times} per R, interleaved with the "
    "other arms ({order}), and the row "
    "shows its fastest run. "
    "**aggregate tok/s**: all tokens generated over the loop's wall time. **per-user median / p10**: each request's "
    "tokens over its own time in flight, median and 10th percentile over the requests. **× plain (per run)**: "
    "aggregate tok/s over plain batched decoding's fastest run, then {per_run}. **1+ℓ̄**: tokens "
    "verified per request and step (the anchor plus ℓ drafts; 1 = no drafts, paper Fig. 8). **τ**: tokens emitted "
    "per request and step, bonus token included. **rejected**: drafts verified but not accepted. **drafting "
    "steps**: steps in which the drafter ran, of all steps that advanced a running request. **step ms**: median "
    "wall time of such a step. **pred. error**: median absolute error of the step-cost model's predicted step time "
    "(scheduled modes only). **mismatches**: requests whose greedy output differs from plain batched decoding's."
)
BEST_FIXED_LEGEND = " `best_fixed` is the fastest fixed k of {ks} at this R (an oracle: each R picks its own k)."
PAIRED_LEGEND = (
    " Paired protocol (`--concurrency-paired`): at each R plain batched decoding ran before every other closed loop "
    "and once at the end, the other loops rotated each repetition, so plain ran {plain} and the fastest-run "
    "columns compare an arm's best of {repeats} with plain's best of more. **× adjacent plain**: each run's "
    "aggregate tok/s over the mean of the plain runs just before and just after it (the list in × plain), "
    "median over the {runs} and (min-max); then the median of the same ratio for the per-user median tok/s. "
    "Read this column on a machine whose speed drifts: the pairs share their minutes."
)
LOCKSTEP_LEGEND = (
    " Lockstep protocol (`--concurrency-lockstep`, `dspark_hf.bench.lockstep`): each run of an arm other than plain "
    "ran in lockstep with a plain closed loop of its own ({plain}): one step of each in turn, in one "
    "process, each loop's time the sum of its own steps (its forward, drafting and bookkeeping; never the other's), "
    "so the machine's drift hits both alike; the first turn alternated between plain and the arm. Tok/s and step "
    "times are on those own times. **× plain in lockstep**: each run's aggregate tok/s over its plain partner's "
    "(the list in × plain), median over the {runs} and (min-max); then the median of the same ratio for the "
    "per-user median tok/s."
)


def markdown(result: dict) -> str:
    """The run's notes, then the table of :func:`run_concurrency` as Markdown (× plain: fastest over fastest, then
    run by run; with the paired protocol a column × adjacent plain, in lockstep × plain in lockstep), then
    :data:`LEGEND` (and :data:`BEST_FIXED_LEGEND` when that arm ran, :data:`PAIRED_LEGEND` or
    :data:`LOCKSTEP_LEGEND`), what each column means."""
    settings = result["settings"]
    lockstep = settings.get("protocol") == "lockstep"
    paired = lockstep or settings.get("protocol") == "paired"
    lines = ["| R | arm | aggregate tok/s | per-user median / p10 | × plain (per run) |"
             + (f" × {'plain in lockstep' if lockstep else 'adjacent plain'}: median (range); per user |"
                if paired else "")
             + " 1+ℓ̄ | τ | rejected | drafting steps | step ms | pred. error | mismatches |",
             "|---|---|---|---|---|" + ("---|" if paired else "") + "---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        error = f"{100 * r['predicted_step_error_median']:.0f} %" if r["predicted_step_error_median"] is not None else "—"
        arm = f"best_fixed (k = {r['k']})" if r["arm"] == "best_fixed" else r["arm"]
        per_run = r.get("speed_vs_plain_paired") or []
        speed = f"{r['speed_vs_plain']:.2f}" + (f" ({' / '.join(f'{x:.2f}' for x in per_run)})" if len(per_run) > 1 else "")
        if paired:
            speed += (f" | {r['paired_median']:.3f} ({r['paired_range'][0]:.3f}-{r['paired_range'][1]:.3f}); "
                      f"{r['paired_median_per_user']:.3f}" if r.get("paired_median") is not None else " | —")
        lines.append(f"| {r['concurrency']} | {arm} | {r['aggregate_tok_s']:.1f} | "
                     f"{r['per_user_tok_s_median']:.1f} / {r['per_user_tok_s_p10']:.1f} | {speed} | "
                     f"{r['verified_per_request']:.2f} | {r['tau']:.2f} | {r['rejected_drafts']} | "
                     f"{r['drafting_steps']}/{r['steps']} | {r['step_ms_median']:.0f} | {error} | {r['mismatches']} |")
    repeats = settings.get("repeats", REPEATS)
    legend = LEGEND.format(times=counted(repeats, "time"),
                           order="each in lockstep with plain, below" if lockstep else "in the paired order below"
                           if paired else "every other time in reverse order, so plain batched decoding runs first and last",
                           per_run="each run over its plain partner in lockstep (below)" if lockstep else
                           "each run over the plain runs adjacent to it (below)" if paired else "run i over plain's run i")
    if "best_fixed" in settings.get("arms", ARMS):  # the arms that ran (all of them in files that did not say)
        legend += BEST_FIXED_LEGEND.format(ks=", ".join(map(str, settings.get("fixed_ks", FIXED_KS))))
    if paired:
        order = schedule(_runs_of(settings["arms"], settings["gamma"], settings["fixed_ks"]), repeats, True)
        plain = sum(loop == PLAIN for _, loop in order)
        runs = counted(repeats, "run")
        legend += (LOCKSTEP_LEGEND.format(runs=runs, plain=counted(len(order) - plain, "plain run")) if lockstep else
                   PAIRED_LEGEND.format(repeats=repeats, runs=runs, plain=counted(plain, "time")))
    notes = "".join(f"- {note}\n" for note in result.get("notes", []))
    return (f"**Notes**\n\n{notes}\n" if notes else "") + "\n".join(lines) + "\n\n" + legend + "\n"


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
