"""The wall clock of ``dspark bench`` (passes 2 and 3): every greedy method on every prompt, interleaved, ``--repeats``
runs of each, summarised per suite against plain ``generate`` (speedups, the worst prompt, τ, mismatches)."""

from __future__ import annotations

from collections.abc import Sequence

from ..evaluation.runs import Run
from .analysis import first_divergence, median
from .loading import _log_default
from .methods import Method, interleaved_runs, lockstep_runs, rounds_of
from .settings import BenchSettings


def wall_clock_pass(target, drafters, methods: list[Method], suites, settings: BenchSettings, log=_log_default) -> dict:
    """Passes 2 and 3: every method on every prompt, interleaved (order rotated per run), greedy,
    ``settings.repeats`` runs of each per prompt; with ``settings.lockstep`` every run of a method but plain
    (``methods[0]``) in lockstep with a plain run of its own (:func:`~dspark_hf.bench.methods.lockstep_runs`).

    Returns:
        ``{suite: [{"id", "prompt_tokens", "runs": {method: Run}, "repeats": {method: [Run, ...]}}]}``: ``runs``
        holds each method's median run by wall time (:func:`median_run`), ``repeats`` all of them in order; in
        lockstep a prompt also has ``"partners": {method: [plain Run, ...]}``, each run's plain partner.
    """
    first = next((p for prompts in suites.values() for p in prompts), None)
    if first is not None and settings.warmup_tokens > 0:  # allocator, kernels and lazy SPS profiling, untimed
        for method in methods:
            method.run(target, first[1], settings.warmup_tokens, drafters)
    out = {}
    counter = 0
    for suite, prompts in suites.items():
        out[suite] = []
        for index, (prompt_id, ids) in enumerate(prompts):
            record = {"id": prompt_id, "prompt_tokens": len(ids)}
            if settings.lockstep:
                repeats, record["partners"], counter = lockstep_runs(target, ids, methods, settings.repeats,
                                                                     settings.max_new_tokens, drafters, counter)
            else:
                repeats, counter = interleaved_runs(target, ids, methods, settings.repeats, settings.max_new_tokens,
                                                    drafters, counter)
            record.update(runs={name: median_run(r) for name, r in repeats.items()}, repeats=repeats)
            plain = record["runs"]["plain"]
            log(f"[wall] {suite} {index + 1}/{len(prompts)}: plain {plain.tokens_per_s:.1f} tok/s; " + ", ".join(
                f"{m.name} x{speedups(record, m.name)[0]:.2f}" for m in methods[1:]))
            out[suite].append(record)
    return out


def median_run(runs: Sequence[Run]) -> Run:
    """The run of median wall time; of an even number, the faster of the middle two (so of two runs the faster:
    a run slowed by other load is dropped, one sped up by nothing is not possible).

    Raises:
        ValueError: no runs.
    """
    if not runs:
        raise ValueError("median_run needs at least one run")
    return sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]


def speedups(record: dict, method: str) -> tuple[float, list[float]]:
    """A method's speedup over plain on one prompt of :func:`wall_clock_pass`, and each run's.

    Each run's speedup is its tok/s over its plain partner's in lockstep (``record["partners"]``), else over plain's
    run of the same repeat; the prompt's speedup is the median of those ratios in lockstep (both sides of a ratio
    shared the machine's minutes), else the median run's tok/s over plain's median run's.
    """
    partners = record.get("partners", {}).get(method)
    ratios = [r.tokens_per_s / q.tokens_per_s for r, q in zip(record["repeats"][method],
                                                               partners or record["repeats"]["plain"])]
    if partners:
        return median(ratios), ratios
    return record["runs"][method].tokens_per_s / record["runs"]["plain"].tokens_per_s, ratios


def _tau_of_run(run) -> float | None:
    """τ of a speculative run; for the built-in DFlash path ``(new tokens - 1) / rounds`` (the prefill token is
    not a round; a final plain step when one token is left is counted in, so it can exceed the true τ slightly)."""
    if run.stats is not None:
        return run.stats.tau
    rounds = rounds_of(run)
    return (len(run.tokens) - 1) / rounds if rounds else None


def summarize_wall_clock(records: dict, methods: list[Method], log=_log_default) -> tuple[dict, list[dict]]:
    """Per suite and method: median tok/s, speedups, τ, mismatches against plain greedy output.

    Returns:
        ``(summary, mismatches)``; every mismatch is also logged.
    """
    summary, mismatches = {}, []
    for suite, prompts in records.items():
        per_method = {}
        for method in methods:
            rows = []
            for p in prompts:
                run, plain = p["runs"][method.name], p["runs"]["plain"]
                repeats = p["repeats"][method.name]
                diverging = [(w, r) for r in repeats if (w := first_divergence(r.tokens, plain.tokens)) is not None]
                where = diverging[0][0] if diverging else None
                if diverging:
                    mismatches.append({"suite": suite, "prompt": p["id"], "method": method.name, "position": where,
                                       "tokens": len(diverging[0][1].tokens), "plain_tokens": len(plain.tokens)})
                    log(f"MISMATCH {suite}/{p['id']} {method.name}: differs from plain greedy at new token {where}")
                speedup, speedup_runs = speedups(p, method.name)
                rows.append({
                    "id": p["id"],
                    "new_tokens": len(run.tokens),
                    "seconds": run.seconds,
                    "tokens_per_s": run.tokens_per_s,
                    "speedup": speedup,
                    "tau": _tau_of_run(run),
                    "rounds": rounds_of(run),
                    "identical": where is None,
                    "speedup_runs": speedup_runs if len(repeats) > 1 else None,
                })
            plain_median = median([p["runs"]["plain"].tokens_per_s for p in prompts])
            tps = median([r["tokens_per_s"] for r in rows])
            stats = [p["runs"][method.name].stats for p in prompts if p["runs"][method.name].stats is not None]
            per_method[method.name] = {
                "median_tokens_per_s": tps,
                "median_speedup": median([r["speedup"] for r in rows]),  # median of per-prompt ratios
                "min_speedup": min((r["speedup"] for r in rows), default=None),  # the worst prompt (issue #28)
                "speedup_of_medians": tps / plain_median if tps and plain_median else None,
                "tau": pooled_tau(rows),
                "mismatches": sum(not r["identical"] for r in rows),
                "token_sources": {k: sum(st.token_sources()[k] for st in stats) for k in ("lookup", "dspark", "target")}
                if stats else None,
                "per_prompt": rows,
            }
        summary[suite] = per_method
    return summary, mismatches


def pooled_tau(rows: Sequence[dict]) -> float | None:
    """τ over all rounds of a method's runs, ``Σ τ_i · rounds_i / Σ rounds_i`` (as :func:`tau` pools rounds);
    runs without rounds (plain, prompt lookup) are left out, ``None`` if none has any."""
    timed = [(r["tau"], r["rounds"]) for r in rows if r["tau"] is not None and r["rounds"]]
    return sum(t * n for t, n in timed) / sum(n for _, n in timed) if timed else None
