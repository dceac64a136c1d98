"""The floor in ``dspark bench`` (issue #28): what a round that verifies the target's token alone costs against a
plain decoding step, from the floor rounds of the wall-clock pass (:func:`floor_costs`) and from pass 4, the
default method with drafting forced off interleaved with plain ``generate``, or with ``--lockstep`` each run in
lockstep with a plain ``generate`` of its own (:func:`floor_pass`)."""

from __future__ import annotations

from ..evaluation.tables import counted
from .analysis import first_divergence, floor_summary, prompt_floor
from .loading import _log_default
from .methods import Method, floor_methods, interleaved_runs, lockstep_runs
from .settings import BenchSettings


def floor_costs(records: dict, methods: list[Method]) -> dict:
    """The floor of every DSpark method that had rounds verifying the target's token alone (issue #28), per suite:
    ``{method: {suite: floor_summary(...)}}`` (:func:`~dspark_hf.bench.analysis.prompt_floor` per prompt against
    that prompt's plain run); methods and suites without such rounds are left out."""
    costs = {}
    for method in methods:
        if method.drafter is None or method.adapter is not None:
            continue
        per_suite = {suite: floor_summary({p["id"]: prompt_floor([p["runs"]["plain"]], [p["runs"][method.name]])
                                           for p in prompts})
                     for suite, prompts in records.items()}
        per_suite = {suite: v for suite, v in per_suite.items() if v is not None}
        if per_suite:
            costs[method.name] = per_suite
    return costs


def floor_pass(target, drafters, methods: list[Method], suites, settings: BenchSettings,
               log=_log_default) -> tuple[dict, list[dict]]:
    """Pass 4, the floor (issue #28): every drafter's default method with drafting forced off
    (:func:`~dspark_hf.bench.methods.floor_methods`: each round is planned, then verifies the target's token alone,
    through the real assisted loop) and plain ``generate``, interleaved on every prompt ``settings.floor_repeats``
    times (order rotated each time), greedy; every token of every run is such a round, so a suite's ratio rests on
    hundreds of them rather than on the few floor rounds of the wall-clock pass. With ``settings.lockstep`` every
    floor run is instead paired with a plain run of its own, in lockstep
    (:func:`~dspark_hf.bench.methods.lockstep_runs`: one target forward of each in turn, each timed on its own
    turns, so its rounds' and steps' timings are each run's own), and a floor arm is compared with its partners only.

    Returns:
        ``(costs, mismatches)``: ``{method: {suite: floor_summary(...)}}`` (:func:`~dspark_hf.bench.analysis.prompt_floor`
        over each prompt's runs against its plain runs, in lockstep the arm's partners, pooled) and the floor runs
        whose output differs from plain greedy (logged too).
    """
    arms = floor_methods(methods)
    if not arms or settings.floor_repeats == 0:
        return {}, []
    plain, costs, mismatches, counter = Method("plain"), {m.name: {} for m in arms}, [], 0
    for suite, prompts in suites.items():
        per_prompt = {m.name: {} for m in arms}
        for index, (prompt_id, ids) in enumerate(prompts):
            if settings.lockstep:
                runs, partners, counter = lockstep_runs(target, ids, [plain, *arms], settings.floor_repeats,
                                                        settings.max_new_tokens, drafters, counter)
            else:
                runs, counter = interleaved_runs(target, ids, [plain, *arms], settings.floor_repeats,
                                                 settings.max_new_tokens, drafters, counter)
                partners = {arm.name: runs["plain"] for arm in arms}  # every arm against all plain runs
            for arm in arms:
                for run in runs[arm.name]:
                    where = first_divergence(run.tokens, runs["plain"][0].tokens)
                    if where is not None:
                        mismatches.append({"suite": suite, "prompt": prompt_id, "method": f"{arm.name} (floor)",
                                           "position": where, "tokens": len(run.tokens),
                                           "plain_tokens": len(runs["plain"][0].tokens)})
                        log(f"MISMATCH {suite}/{prompt_id} {arm.name} with drafting off: differs from plain greedy "
                            f"at new token {where}")
                floor = per_prompt[arm.name][prompt_id] = prompt_floor(partners[arm.name], runs[arm.name])
                log(f"[floor] {suite} {index + 1}/{len(prompts)} {arm.name}: " + (
                    f"round {floor['round_ms']:.1f} ms / plain step {floor['plain_step_ms']:.1f} ms = "
                    f"{floor['ratio']:.3f} ({counted(floor['floor_rounds'], 'round')})" if floor else "no floor rounds"))
        for name, floors in per_prompt.items():
            summary = floor_summary(floors)
            if summary is not None:
                costs[name][suite] = summary
    return {name: per_suite for name, per_suite in costs.items() if per_suite}, mismatches
