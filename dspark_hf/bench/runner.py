"""``dspark bench``: one command, one run, the paper's §4 measurements on this machine.

What is measured (paper §4; symbols as in :mod:`dspark_hf.decoding.calibration`):

1. τ, accepted length per round INCLUDING the bonus token, under fixed-length verification (every
   round verifies all γ drafts: the Table 1 protocol), greedy and T = 1 sampling, per suite and as
   the macro average over suites; ``tau_ratio_dspark_over_dflash`` = macro τ(dspark) / macro τ(dflash).
2. Position-wise conditional acceptance P(n >= k | n >= k-1) from the same fixed rounds (Fig. 2).
3. Confidence: ECE of the prefix survival a_k before / after STS, ROC-AUC of c_k per position, and a
   static threshold sweep replayed offline on the recorded fixed rounds (Fig. 5).
4. Wall clock, greedy: tokens/s and speedup over plain ``generate`` of plain, prompt lookup, the
   built-in ``speculation_type="dflash"`` path (parallel drafters, through :class:`BuiltinDFlashAdapter`),
   every drafter's verification modes and each calibrated drafter's hybrid with prompt lookup
   (``<drafter>:<mode>+lookup``, :mod:`dspark_hf.decoding.lookup`); methods interleaved prompt by prompt, every greedy
   speculative output checked token-identical to plain ``generate``, and the share of each method's tokens that
   came from lookup, DSpark and the target reported.
5. The machine's SPS curve (one row per context length) and each drafter's cost per round (median draft ms vs
   verify ms), and the floor (issue #28): what a round that verifies the target's token alone costs against a
   plain decoding step, taken apart (:func:`~dspark_hf.bench.analysis.prompt_floor`), measured by pass 4 and
   checked on the floor rounds of pass 2, with the drafter's context extension over the prompt against the
   target's prefill.

Layout: suites (prompt sources) -> pure metrics -> runner -> report (JSON, Markdown, PNG). The runner
works on token ids only, so tests drive it with a tiny random model. It makes four passes over the prompts (the
wall-clock ones, 2 and 3, in :mod:`~dspark_hf.bench.wall_clock`; the floor, 4, in :mod:`~dspark_hf.bench.floor`):

1. one fixed-length generation at T = 1 per drafter and prompt (τ and acceptance at T = 1);
2. every timed greedy method but the threshold mode, interleaved prompt by prompt; the ``<drafter>:fixed``
   runs double as the greedy fixed-length rounds (greedy decoding is deterministic), which give greedy τ,
   acceptance, calibration and the threshold sweep;
3. the threshold mode at the best t of that sweep, interleaved with plain again; skipped when the best t
   is 0, which keeps every draft and so is the fixed mode;
4. the floor (issue #28): each drafter's default method with drafting forced off, interleaved with plain
   ``generate`` ``--floor-repeats`` times per prompt (with ``--lockstep`` each run in lockstep with a plain
   ``generate`` of its own, as passes 2 and 3), so that what a round verifying the target's token alone costs
   against a plain step rests on every token of those runs (:func:`~dspark_hf.bench.floor.floor_pass`).

Suites: ``code`` = HumanEval; ``chat`` = held-out ShareGPT (``sharegpt_prompts("test")``, never
train/validation/calibration) minus the math ones; ``math`` = the held-out ShareGPT conversations that
:func:`is_math_problem` accepts; ``custom`` = a JSONL file of ``{"prompt": ...}`` lines; ``long`` and ``low-accept``
(:mod:`dspark_hf.bench.suites`) when named.

Budget of the defaults (``BenchSettings``: 4 prompts per suite, 96 new tokens, three drafters) on a 2-core
CPU where plain greedy runs at ~20 tok/s: 3 + 12 (+ 3) generations per prompt (two of them the ``+lookup``
hybrids), 12 prompts x ~15 generations x ~5 s ≈ 14-17 min, and the floor pass 2 x (1 + 2) more per prompt (~3 min). ``--limit N`` is a quick run at 32 new tokens (see :func:`settings_from_args`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

from ..decoding.stats import full_rounds
from ..evaluation.bench_result import (
    SCHEMA_VERSION,
    BenchResult,
    BuiltinDFlash,
    DrafterConfidence,
    DrafterRecord,
    FloorCost,
    MachineRecord,
    MathFilter,
    MethodSummary,
    Mismatch,
    RoundCost,
    RunSettings,
    SPSRecord,
    SuiteRecord,
    WallClock,
)
from ..evaluation.tables import counted
from ..metrics import conditional_acceptance, tau
from .analysis import (
    best_threshold,
    confidence_summary,
    median,
    threshold_sweep,
)
from .floor import floor_costs, floor_pass
from .loading import DrafterSource, _log_default
from .methods import (
    Method,
    builtin_adapters,
    describe_drafter,
    floor_methods,
    merge_threshold_methods,
    plan_methods,
    threshold_methods,
)
from .settings import BenchSettings
from .wall_clock import summarize_wall_clock, wall_clock_pass


def sampled_rounds_pass(target, drafters, suites, settings: BenchSettings, log=_log_default) -> dict:
    """Pass 1: one fixed-length generation at T = ``settings.sampling_temperature`` per drafter and prompt.

    The greedy fixed-length rounds need no pass of their own: see :func:`greedy_rounds`.

    Returns:
        ``{drafter: {suite: [GenerationStats, ...]}}``.
    """
    from ..evaluation.runs import timed_generate

    out = {d: {s: [] for s in suites} for d in drafters}
    for suite, prompts in suites.items():
        for index, (prompt_id, ids) in enumerate(prompts):
            for name, drafter in drafters.items():
                run = timed_generate(target, ids, settings.max_new_tokens, settings.sampling_temperature, drafter,
                                     seed=index, dspark_verification="fixed", dspark_block_size=settings.gamma,
                                     dspark_lookup=False)
                out[name][suite].append(run.stats)
                log(f"[rounds] {suite} {index + 1}/{len(prompts)} {name} t1: τ={run.stats.tau:.2f} "
                    f"({len(run.tokens)} tok, {run.seconds:.1f} s)")
    return out


def greedy_rounds(records: dict, drafters) -> dict:
    """The greedy fixed-length rounds of the Table 1 protocol, taken from pass 2's ``<drafter>:fixed`` runs.

    Greedy decoding is deterministic, so the timed ``fixed`` run of a prompt is that prompt's τ run; running
    it again untimed would repeat the same rounds.

    Returns:
        ``{drafter: {suite: [GenerationStats, ...]}}``, as :func:`sampled_rounds_pass`.
    """
    return {name: {suite: [p["runs"][f"{name}:fixed"].stats for p in prompts] for suite, prompts in records.items()}
            for name in drafters}


def tau_mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def round_costs(records: dict, methods: list[Method]) -> dict:
    """Median draft ms and verify ms per round of every DSpark method in pass 2 (after warm-up)."""
    costs = {}
    for method in methods:
        if method.drafter is None or method.adapter is not None:
            continue
        rounds = [r for prompts in records.values() for p in prompts for r in p["runs"][method.name].stats.rounds]
        costs[method.name] = {
            "rounds": len(rounds),
            "median_draft_ms": median([r.draft_ms for r in rounds]),
            "median_verify_ms": median([r.verify_ms for r in rounds if r.verify_ms > 0]),
            "mean_scheduled": sum(r.scheduled for r in rounds) / len(rounds) if rounds else None,
        }
    return costs


def step_seconds_table(sps, draft_ms: float | None, gamma: int) -> list[float] | None:
    """``[draft + 1 / SPS(ℓ + 1) for ℓ = 0..γ]`` in seconds (``None`` when the curve is too short)."""
    if sps is None or len(sps.steps_per_s) < gamma + 1:
        return None
    return [(draft_ms or 0.0) / 1e3 + 1.0 / sps.steps_per_s[ell] for ell in range(gamma + 1)]


def tau_tables(stats: dict, suites: list[str], gamma: int) -> tuple[dict, dict, dict]:
    """τ per suite and macro, conditional acceptance, and the macro τ ratio dspark / dflash.

    Args:
        stats: ``{"greedy"|"t1": {drafter: {suite: [GenerationStats, ...]}}}`` of fixed-length generations.

    Returns:
        ``(taus, conditional, ratios)``: ``taus[key][drafter][suite|"macro"]``,
        ``conditional[key][suite][drafter]`` (γ values) and ``ratios[key]`` (``None`` without both drafters).
    """
    taus, cond, ratios = {}, {}, {}
    for key, per_drafter in stats.items():
        taus[key], cond[key] = {}, {s: {} for s in suites}
        for name, per_suite in per_drafter.items():
            row = {s: tau([r.accepted for st in per_suite[s] for r in st.rounds]) for s in suites}
            row["macro"] = tau_mean([row[s] for s in suites])
            taus[key][name] = row
            for s in suites:
                cond[key][s][name] = conditional_acceptance(full_rounds(per_suite[s], gamma)[0], gamma)
        a, b = (taus[key].get(n, {}).get("macro") for n in ("dspark", "dflash"))
        ratios[key] = a / b if a and b else None
    return taus, cond, ratios


def confidence_tables(drafters: dict, greedy: dict, suites: list[str], sps, settings: BenchSettings) -> tuple[dict, dict]:
    """Calibration and static threshold sweep per drafter with a confidence head, from greedy fixed rounds.

    Args:
        greedy: ``{drafter: {suite: [GenerationStats, ...]}}`` (see :func:`greedy_rounds`).

    Returns:
        ``(confidence, thresholds)``: per drafter the calibration summary and sweep per suite and ``"all"``,
        and the best threshold by modelled tokens/s (:func:`best_threshold`).
    """
    confidence, thresholds = {}, {}
    for name, drafter in drafters.items():
        if drafter.confidence is None:
            continue
        pooled = sum(greedy[name].values(), [])
        table = step_seconds_table(sps, median([r.draft_ms for st in pooled for r in st.rounds]), settings.gamma)
        entry = {"step_seconds": table, "suites": {}}
        for s in [*suites, "all"]:
            accepted, confs = full_rounds(pooled if s == "all" else greedy[name][s], settings.gamma)
            entry["suites"][s] = {
                "calibration": confidence_summary(confs, accepted, drafter.calibration),
                "threshold_sweep": threshold_sweep(confs, accepted, settings.thresholds, table) if confs else [],
            }
        thresholds[name] = entry["best_threshold"] = best_threshold(entry["suites"]["all"]["threshold_sweep"])
        confidence[name] = entry
    return confidence, thresholds


def run_bench(target, drafters: dict, suites: dict, settings: BenchSettings, sps=None, notes: list[str] | None = None,
              builtin_dflash: bool = True, command: str = "", log: Callable = _log_default,
              sources: dict[str, DrafterSource] | None = None) -> tuple[dict, dict]:
    """Run the whole bench on prompts given as token ids.

    Args:
        target: the causal LM (eval mode).
        drafters: ``{name: DSparkDrafter}``, bound to ``target``, each with a ``calibration``.
        suites: ``{suite: [(prompt_id, ids), ...]}``.
        settings: :class:`BenchSettings`.
        sps: the target's :class:`~dspark_hf.SPSCurve` (default: :func:`~dspark_hf.load_or_profile_sps`);
            it is also the scheduler's curve for every drafter.
        notes: notes gathered while loading, carried into the result.
        builtin_dflash: also time the built-in DFlash path for parallel drafters.
        command: the command line recorded in ``result.machine``.
        sources: where each drafter came from (:func:`~dspark_hf.bench.loading.load_drafters`); default: unknown.

    Returns:
        ``(result, raw)``: the :class:`~dspark_hf.evaluation.bench_result.BenchResult` (non-finite floats ``None``,
        as ``benchmarks.json`` holds them) and the raw records the plots need.
    """
    from ..runtime.profiling import load_or_profile_sps

    notes = list(notes or [])
    start = time.perf_counter()
    # Phase 0: the machine's SPS curve; the scheduler of every drafter uses the same one.
    sps = sps or load_or_profile_sps(target, max_tokens=settings.gamma + 1)  # what the schedulers read
    for drafter in drafters.values():
        drafter.set_sps_curve(sps)
    # Passes 1-3: τ rounds, wall clock, the threshold mode at its best t.
    passes = _run_passes(target, drafters, suites, settings, sps, builtin_dflash, notes, log)
    log(f"[bench] greedy mismatches against plain generate: {len(passes['mismatches'])}")
    sources = sources or {}
    records = {n: DrafterRecord(**describe_drafter(d, sources.get(n, DrafterSource()))) for n, d in drafters.items()}
    result = _bench_result(target, suites, settings, sps, passes, command, notes, records, time.perf_counter() - start)
    return result.strict(), {"stats": passes["stats"], "records": passes["records"]}


def _run_passes(target, drafters: dict, suites: dict, settings: BenchSettings, sps, builtin_dflash: bool,
                notes: list[str], log: Callable) -> dict:
    """Passes 1-3 of :func:`run_bench` (notes appended to ``notes``); returns their tables by name."""
    # Pass 1: fixed-length rounds at T = 1.
    log(f"[bench] pass 1: T = {settings.sampling_temperature} fixed-length rounds (γ={settings.gamma}) of "
        f"{counted(len(drafters), 'drafter')} on {counted(sum(map(len, suites.values())), 'prompt')}")
    sampled = sampled_rounds_pass(target, drafters, suites, settings, log)

    # Pass 2: wall clock, greedy, methods interleaved prompt by prompt; its fixed runs are the greedy τ rounds.
    adapters, builtin = builtin_adapters(drafters, settings.gamma, builtin_dflash)
    methods = plan_methods(drafters, adapters, settings)
    log(f"[bench] pass 2: wall clock of {counted(len(methods), 'method')}: {', '.join(m.name for m in methods)}")
    records = wall_clock_pass(target, drafters, methods, suites, settings, log)
    stats = {"greedy": greedy_rounds(records, drafters), "t1": sampled}
    taus, cond, ratios = tau_tables(stats, list(suites), settings.gamma)
    if ratios.get("greedy") is None:
        notes.append("tau_ratio_dspark_over_dflash needs drafters named 'dspark' and 'dflash'; not computed.")
    confidence, thresholds = confidence_tables(drafters, stats["greedy"], list(suites), sps, settings)

    # Pass 3: the threshold mode at the best t of the sweep, interleaved with plain once more.
    timed = threshold_methods(thresholds, settings)
    notes += [f"{n}: the best static threshold is t = 0, which keeps every draft: `{n}:threshold` is `{n}:fixed` "
              "and is not timed twice." for n, t in thresholds.items() if t == 0]
    wall, mismatches = summarize_wall_clock(records, methods, log)
    costs, floor = round_costs(records, methods), floor_costs(records, methods)
    if timed:
        log(f"[bench] pass 3: wall clock of {', '.join(m.name for m in timed)} at the best threshold, against plain")
        extra = wall_clock_pass(target, drafters, [Method("plain"), *timed], suites, settings, log)
        more, more_mismatches = summarize_wall_clock(extra, timed, log)
        methods, wall = merge_threshold_methods(methods, timed, wall, more)
        mismatches += more_mismatches
        costs.update(round_costs(extra, timed))
        notes.append("Threshold-mode speedups are measured against a plain run interleaved with them in pass 3.")

    # Pass 4: the floor, the default methods with drafting forced off, interleaved with plain.
    if settings.floor_repeats and floor_methods(methods):
        log(f"[bench] pass 4: the floor of {', '.join(m.name for m in floor_methods(methods))} with drafting off, "
            f"against plain, {counted(settings.floor_repeats, 'time')} per prompt")
    floor_passed, floor_mismatches = floor_pass(target, drafters, methods, suites, settings, log)
    mismatches += floor_mismatches
    return {"stats": stats, "records": records, "taus": taus, "cond": cond, "ratios": ratios,
            "confidence": confidence, "thresholds": thresholds, "methods": methods, "wall": wall,
            "mismatches": mismatches, "costs": costs, "floor": floor, "floor_pass": floor_passed, "builtin": builtin}


def _bench_result(target, suites: dict, settings: BenchSettings, sps, passes: dict, command: str, notes: list[str],
                  drafters: dict[str, DrafterRecord], runtime_s: float) -> BenchResult:
    """The typed :class:`BenchResult` of :func:`run_bench`'s passes (:func:`_run_passes`)."""
    from ..runtime.targets import kernels_label
    from ..sources import categories

    mismatches, ratios = passes["mismatches"], passes["ratios"]
    return BenchResult(
        schema_version=SCHEMA_VERSION,
        machine=MachineRecord.current(command, kernels_label(target)),
        settings=RunSettings(**{**asdict(settings), "thresholds": list(settings.thresholds)}, math_filter=MathFilter(
            keywords_or_arithmetic=categories.MATH_PATTERN.pattern, excluded=categories.NOT_MATH_PATTERN.pattern,
            max_chars=categories.MATH_MAX_CHARS)),
        suites={s: SuiteRecord(n_prompts=len(p), ids=[i for i, _ in p], prompt_tokens=[len(x) for _, x in p])
                for s, p in suites.items()},
        drafters=drafters,
        tau_ratio_dspark_over_dflash=ratios.get("greedy"),
        tau_ratios=ratios,
        tau=passes["taus"],
        conditional_acceptance=passes["cond"],
        confidence={n: DrafterConfidence.from_json(entry) for n, entry in passes["confidence"].items()},
        wall_clock=WallClock(methods=[m.name for m in passes["methods"]], thresholds=dict(passes["thresholds"]),
                             suites={s: {m: MethodSummary.from_json(v) for m, v in per.items()}
                                     for s, per in passes["wall"].items()},
                             mismatches_total=len(mismatches), mismatches=[Mismatch(**m) for m in mismatches]),
        builtin_dflash=BuiltinDFlash(**passes["builtin"]),
        sps=SPSRecord.from_curve(sps),
        round_cost={m: RoundCost(**c) for m, c in passes["costs"].items()},
        floor_cost={m: {s: FloorCost(**c) for s, c in per.items()} for m, per in passes["floor"].items()},
        floor_pass={m: {s: FloorCost(**c) for s, c in per.items()} for m, per in passes["floor_pass"].items()} or None,
        notes=notes,
        runtime_s=runtime_s,
    )
