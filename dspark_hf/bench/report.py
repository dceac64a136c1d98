"""The report of ``dspark bench``: ``benchmarks.json``, ``benchmarks.md`` (tables) and the PNG plots."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ..decoding.stats import full_rounds
from ..evaluation.bench_result import BenchResult, as_bench_result
from ..evaluation.tables import counted, format_number, markdown_table


def _table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    return markdown_table(headers, rows, lambda v: v if isinstance(v, str) else format_number(v, 2))


def _sources(counts: dict | None) -> str:
    """``"lookup / dspark / target"`` shares of a method's tokens in percent (``–`` for methods without rounds)."""
    total = sum(counts.values()) if counts else 0
    if not total:
        return "–"
    return " / ".join(f"{100 * counts[k] / total:.0f}%" for k in ("lookup", "dspark", "target"))


def _own_baseline_note(name: str, summary) -> str:
    """Why a threshold row's speedup does not match its tok/s against the plain row: it ran in pass 3, interleaved
    with a plain run of its own (whose median tok/s its ``speedup_of_medians`` implies)."""
    if not summary.median_tokens_per_s or not summary.speedup_of_medians:
        return ""
    plain = summary.median_tokens_per_s / summary.speedup_of_medians
    return (f"`{name}` ran after the sweep that picked its t, interleaved with a plain run of its own (median "
            f"{plain:.1f} tok/s): its speedups are against that run, not the plain row above.\n")


def markdown_report(result: BenchResult | dict) -> str:
    """The tables of ``benchmarks.md`` (a dict is read as ``benchmarks.json``, :meth:`BenchResult.from_json`)."""
    result = as_bench_result(result)
    out = _header_section(result) + _tau_section(result) + _conditional_section(result) + _confidence_section(result)
    out += _wall_clock_section(result) + _cost_section(result)
    if result.plots:
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in result.plots] + [""]
    return "\n".join(out)


def _header_section(result: BenchResult) -> list[str]:
    """Title, command, machine and settings lines, and the run's notes."""
    m, s = result.machine, result.settings
    out = [
        "# dspark bench",
        "",
        f"`{m.command}`  ",
        f"{m.date} · {m.cpu}{f' ({m.isa})' if m.isa else ''} · {m.cores} cores ({m.torch_threads} torch threads) · torch {m.torch} · "
        f"transformers {m.transformers} · linear kernels: {m.linear_kernels} · "
        f"runtime {result.runtime_s / 60:.1f} min",
        "",
        f"γ = {s.gamma}, {s.max_new_tokens} new tokens, up to {counted(s.limit, 'prompt')} per suite "
        f"(≤ {s.max_prompt_tokens} prompt tokens): "
        + ", ".join(f"{n} {v.n_prompts}" for n, v in result.suites.items()) + ".",
        "",
    ]
    if result.notes:
        out += ["**Notes**", ""] + [f"- {n}" for n in result.notes] + [""]
    return out


def _tau_section(result: BenchResult) -> list[str]:
    """τ per drafter and suite, greedy and sampled, and the macro τ ratio dspark / dflash."""
    suites, s = list(result.suites), result.settings
    out = ["## τ (accepted length per round, bonus included; fixed-length verification)", ""]
    for key, label in (("greedy", "greedy"), ("t1", f"T = {s.sampling_temperature}")):
        rows = [[name, *(row[x] for x in suites), row["macro"]] for name, row in result.tau[key].items()]
        out += [f"**{label}**", "", _table(["drafter", *suites, "macro"], rows), ""]
    ratios = result.tau_ratios
    return out + [f"macro τ(dspark) / macro τ(dflash): greedy {format_number(ratios.get('greedy'), 3)}, "
                  f"T = 1 {format_number(ratios.get('t1'), 3)}", ""]


def _conditional_section(result: BenchResult) -> list[str]:
    """Position-wise conditional acceptance per suite (paper Fig. 2)."""
    out = ["## Position-wise conditional acceptance P(n ≥ k | n ≥ k−1)", "",
           "Fixed rounds that verified all γ drafts (the last round of each generation dropped); – where no "
           "round reached position k−1.", ""]
    for suite in result.suites:
        rows = [[f"{name} ({key})", *vals] for key in ("greedy", "t1")
                for name, vals in result.conditional_acceptance[key][suite].items()]
        header = ["drafter", *(f"k={k}" for k in range(1, result.settings.gamma + 1))]
        out += [f"**{suite}**", "", _table(header, rows), ""]
    return out


def _confidence_section(result: BenchResult) -> list[str]:
    """Calibration per drafter (ECE before / after STS, ROC-AUC) and the static threshold sweeps."""
    out = ["## Confidence (greedy fixed rounds)", "",
           "ECE of the prefix survival probability a_k = c_1···c_k against 1[n ≥ k] over all rounds (every round "
           "has a label at every position; deep positions, with a_k and the survival rate near 0, have a small "
           "ECE); ROC-AUC of c_k on the rounds that reached k (n ≥ k−1), – where one class is absent.", ""]
    for name, entry in result.confidence.items():
        cal = entry.suites["all"].calibration
        if cal is None:
            out += [f"**{name}**: no full rounds.", ""]
            continue
        out += [f"**{name}** ({counted(cal.rounds, 'round')}, all suites): mean ECE of a_k {100 * cal.mean_ece_before:.1f}% "
                f"before STS → {100 * cal.mean_ece_after:.1f}% after; best static threshold by modelled "
                f"tokens/s (SPS curve + median draft cost): t = {format_number(entry.best_threshold, 1)}", ""]
        rows = [[p.position, p.survival_rate, 100 * p.ece_before, 100 * p.ece_after, p.roc_auc, p.n_conditional]
                for p in cal.positions]
        out += [_table(["k", "survival", "ECE before %", "ECE after %", "ROC-AUC", "n (n ≥ k−1)"], rows), ""]
        out += _sweep_table(result, entry)
    return out


def _sweep_table(result: BenchResult, entry) -> list[str]:
    """One drafter's static threshold sweep, one column per suite with a sweep (and "all")."""
    panels = [x for x in [*result.suites, "all"] if entry.suites[x].threshold_sweep]
    if not panels:
        return []
    sweeps = [entry.suites[x].threshold_sweep for x in panels]
    rows = [[format_number(sweeps[0][i].threshold, 1),
             *(f"{format_number(sw[i].accepted_per_step, 2)} / {format_number(sw[i].rejected_per_step, 2)} / "
               f"{format_number(100 * sw[i].acceptance_rate, 1)}%" for sw in sweeps),
             sweeps[-1][i].modelled_tokens_per_s] for i in range(len(sweeps[0]))]
    return ["Static threshold sweep (accepted incl. bonus / rejected per step / acceptance rate):", "",
            _table(["t", *panels, "modelled tok/s (all)"], rows), ""]


def _wall_clock_section(result: BenchResult) -> list[str]:
    """Greedy wall clock per suite and method, the worst prompts, and the built-in dflash status."""
    wall = result.wall_clock
    repeats = result.settings.repeats or 1
    runs = (f"; {repeats} runs of each per prompt, a prompt's figures are those of each method's median run by wall "
            "time" if repeats > 1 else "")
    if result.settings.lockstep:
        runs = (f"; each run of a method in lockstep with a plain `generate` of its own (one target forward of each "
                f"in turn, each timed on its own turns: `--lockstep`), {counted(repeats, 'such pair')} "
                f"per prompt, a prompt's speedup the median of its pairs' ratios, its tok/s those of the median run")
    out = [f"## Wall clock (greedy; methods interleaved per prompt{runs})", "",
           f"Greedy outputs differing from plain `generate`: **{wall.mismatches_total}**", ""]
    for suite, per_method in wall.suites.items():
        rows = [[name, v.median_tokens_per_s, v.median_speedup, v.min_speedup, v.speedup_of_medians, v.tau,
                 _sources(v.token_sources), v.mismatches] for name, v in per_method.items()]
        out += [f"**{suite}**", "", _table(["method", "median tok/s", "median per-prompt speedup",
                                            "min per-prompt speedup", "speedup of medians", "τ",
                                            "tokens from lookup / DSpark / target", "mismatches"], rows), ""]
        out += [_own_baseline_note(name, v) for name, v in per_method.items() if name.endswith(":threshold")]
    out += _worst_prompts(wall)
    b = result.builtin_dflash
    return out + [f"Built-in `speculation_type=\"dflash\"`: {b.status}. {b.note}", ""]


def _cost_section(result: BenchResult) -> list[str]:
    """Cost per round, the floor table and the SPS curve per context length."""
    out = ["## Cost per round and SPS curve", ""]
    rows = [[name, v.rounds, v.median_draft_ms, v.median_verify_ms, v.mean_scheduled]
            for name, v in result.round_cost.items()]
    out += [_table(["method", "rounds", "median draft ms", "median verify ms", "mean ℓ"], rows), ""]
    out += _floor_section(result)
    sps = result.sps
    shown = [b for b in (1, 2, 4, 8, 16, 32) if b <= len(sps.ms_per_step)]
    by_context = sps.ms_per_step_by_context or {str(sps.context_len): sps.ms_per_step}
    rows = [[f"ctx {c}", *(ms[b - 1] for b in shown), ms[shown[-1] - 1] / ms[0]] for c, ms in by_context.items()]
    return out + [f"SPS curve ({sps.device_name}), ms per verification step of B tokens, one row per context "
                  "length (as the schedulers read it at the end of the run):", "",
                  _table(["context", *(f"B={b}" for b in shown), f"B={shown[-1]} / B=1"], rows), ""]


def _worst_prompts(wall) -> list[str]:
    """The per-prompt minimum speedup of every method over all suites (issue #28: the default must not lose on
    any prompt)."""
    rows = []
    for method in wall.methods:
        runs = [(suite, r) for suite, per in wall.suites.items() if method in per for r in per[method].per_prompt]
        if not runs:
            continue
        suite, worst = min(runs, key=lambda x: x[1].speedup)
        rows.append([method, len(runs), worst.speedup, f"{suite}/{worst.id}",
                     sum(r.speedup < 0.98 for _, r in runs), sum(r.speedup < 1.0 for _, r in runs)])
    if not rows:
        return []
    return ["**Every prompt** (all suites): the worst per-prompt speedup of each method", "",
            _table(["method", "prompts", "min speedup", "on", "prompts < 0.98×", "prompts < 1.0×"], rows), ""]


def _ratio(value: float | None) -> str:
    """A floor ratio with three decimals (the goal is ≤ 1.03: two would round 1.034 down to it)."""
    return "–" if value is None else f"{value:.3f}"


def _floor_section(result: BenchResult) -> list[str]:
    """The floor tables (issue #28): a round that verifies the target's token alone against a plain step, measured
    by the floor pass (drafting forced off, hundreds of rounds; each run in lockstep with a plain one under
    ``--lockstep``), then the floor rounds that happened inside the wall-clock runs."""
    out = []
    parts = ("plain_step_ms", "plain_forward_ms", "plain_loop_ms", "round_ms", "forward_ms", "plan_ms",
             "bookkeeping_ms", "loop_ms")
    columns = ["plain step", "plain forward", "plain loop", "floor round", "forward", "planning", "bookkeeping",
               "assisted loop", "round / step"]
    if result.floor_pass:
        repeats = result.settings.floor_repeats
        protocol = ("each run in lockstep with a plain `generate` of its own on the same prompt (one target forward of "
                    f"each in turn, each timed on its own turns: `--lockstep`), {counted(repeats, 'such pair')} per "
                    "prompt, a floor run's rounds against its partners' steps" if result.settings.lockstep else
                    f"interleaved with plain `generate` on the same prompts, {counted(repeats, 'run')} of each per prompt")
        rows = [[f"{method} · {suite}", f.prompts, f.floor_rounds, *(getattr(f, k) for k in parts), _ratio(f.ratio),
                 _ratio(f.worst_ratio), f.worst_prompt] for method, per_suite in result.floor_pass.items() for suite, f in per_suite.items()]
        out += [f"**The floor** (pass 4): the default method with drafting forced off, so that every round verifies "
                f"only the target's own token (planned as usual, nothing drafted, the drafter not run), {protocol}; "
                "medians in ms over each prompt's rounds and steps, then over prompts. A round = the target's forward "
                "(hidden states captured) + lookup planning + DSpark's bookkeeping (features collected, costs learnt, "
                "online updates) + transformers' assisted loop (inputs, acceptance, cache crop, stopping); a plain "
                "step = forward + generate's loop.", "",
                _table(["method · suite", "prompts", "rounds", *columns, "worst prompt", "on"], rows), ""]
    elif result.settings.floor_repeats == 0:
        out += ["**The floor** (pass 4) was skipped (`--floor-repeats 0`).", ""]
    if result.floor_cost:
        rows = [[f"{method} · {suite}", f.prompts, f.floor_rounds, *(getattr(f, k) for k in parts), _ratio(f.ratio),
                 _ratio(f.worst_ratio), f.context_ms_per_token, f.prefill_ms, f.prefill_extension_ms]
                for method, per_suite in result.floor_cost.items() for suite, f in per_suite.items()]
        out += ["**Floor rounds inside the wall-clock runs**: the rounds of pass 2 that verified only the target's "
                "own token, against the plain steps of the same prompts (few per prompt: a check, not the "
                "measurement). Each leaves one position for the drafter's context, appended in the next drafted "
                "round (ms per position). Prefill: the target's, and the drafter's context extension over the "
                "prompt.", "",
                _table(["method · suite", "prompts", "floor rounds", *columns, "worst prompt",
                        "context ms / position", "prefill", "drafter extension"], rows), ""]
    return out


def _figure(ncols=1, nrows=1, width=4.0, height=3.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def write_plots(result: BenchResult, raw: dict, out_dir: Path, drafters: dict) -> list[str]:
    """Conditional acceptance per suite, threshold sweep per drafter, SPS curve, reliability, speedups.

    Args:
        result: the run's result. raw: the runner's raw records (``raw["stats"]`` for the reliability diagrams).
        out_dir: where the PNGs go. drafters: ``{name: DSparkDrafter}`` (their calibration).

    Returns:
        The file names written, in order.
    """
    written = _plot_conditional_acceptance(result, out_dir) + _plot_confidence(result, raw, out_dir, drafters)
    written += [_plot_sps_curve(result, out_dir), _plot_speedups(result, out_dir)]
    return [Path(p).name for p in written]


def _plot_conditional_acceptance(result: BenchResult, out_dir: Path) -> list[str]:
    """One PNG per suite: conditional acceptance per position, greedy and sampled (paper Fig. 2)."""
    written, positions = [], list(range(1, result.settings.gamma + 1))
    for suite in result.suites:  # paper Fig. 2
        fig = _figure()
        ax = fig.add_subplot()
        for i, name in enumerate(result.drafters):
            for key, style in (("t1", "-"), ("greedy", "--")):
                vals = result.conditional_acceptance[key][suite][name]
                ys = [float("nan") if v is None else v for v in vals]
                ax.plot(positions, ys, style, marker="o", markersize=3, color=f"C{i}", label=f"{name} ({key})")
        ax.set(title=f"{suite}: conditional acceptance", xlabel="draft position k", ylabel="P(n ≥ k | n ≥ k−1)",
               xticks=positions)
        ax.legend(fontsize="x-small")
        written.append(_save(fig, out_dir / f"conditional_acceptance_{suite}.png"))
    return written


def _plot_confidence(result: BenchResult, raw: dict, out_dir: Path, drafters: dict) -> list[str]:
    """Per drafter: the static threshold sweep (paper Fig. 5) and the reliability diagram of its calibration."""
    from ..decoding.calibration import reliability_diagram

    written, gamma = [], result.settings.gamma
    for name, entry in result.confidence.items():  # paper Fig. 5
        panels = [s for s in [*result.suites, "all"] if entry.suites[s].threshold_sweep]
        if not panels:
            continue
        fig = _figure(ncols=len(panels))
        for i, suite in enumerate(panels):
            sweep = entry.suites[suite].threshold_sweep
            ts = [r.threshold for r in sweep]
            acc, rej = [r.accepted_per_step for r in sweep], [r.rejected_per_step for r in sweep]
            ax = fig.add_subplot(1, len(panels), i + 1)
            ax.bar(ts, acc, width=0.08, color="C0", label="accepted tokens")
            ax.bar(ts, rej, width=0.08, bottom=acc, color="C3", hatch="//", alpha=0.6, label="rejected tokens")
            ax.set(title=f"{name}: {suite}", xlabel="confidence threshold", ylabel="avg. tokens per step")
            twin = ax.twinx()
            twin.plot(ts, [100 * r.acceptance_rate for r in sweep], color="k", marker="o", markersize=3,
                      label="acceptance rate")
            twin.set(ylim=(0, 105), ylabel="acceptance rate %")
            if i == 0:
                ax.legend(fontsize="x-small", loc="upper right")
        written.append(_save(fig, out_dir / f"threshold_sweep_{name}.png"))
        drafter = drafters.get(name)
        accepted, confs = full_rounds(sum(raw["stats"]["greedy"][name].values(), []), gamma)
        if drafter is not None and confs:
            written.append(str(reliability_diagram(torch.tensor(confs, dtype=torch.float64), torch.tensor(accepted),
                                                   drafter.calibration, out_dir / f"reliability_{name}.png")))
    return written


def _plot_sps_curve(result: BenchResult, out_dir: Path) -> str:
    """The target's verification cost (ms per step of B tokens), one line per context length."""
    fig = _figure()
    ax = fig.add_subplot()
    sps = result.sps
    for context, ms in (sps.ms_per_step_by_context or {str(sps.context_len): sps.ms_per_step}).items():
        ax.plot(range(1, len(ms) + 1), ms, marker="o", markersize=3, label=f"context {context}")
    ax.set(title="target verification cost", xlabel="tokens verified B", ylabel="ms per step", ylim=(0, None))
    ax.legend(fontsize="x-small")
    return _save(fig, out_dir / "sps_curve.png")


def _plot_speedups(result: BenchResult, out_dir: Path) -> str:
    """Median per-prompt greedy speedup over plain ``generate``, per method and suite."""
    suites, methods = list(result.wall_clock.suites), result.wall_clock.methods
    fig = _figure(width=max(5.0, 0.6 * len(methods) * len(suites)))
    ax = fig.add_subplot()
    width = 0.8 / max(len(suites), 1)
    for i, suite in enumerate(suites):
        vals = [result.wall_clock.suites[suite][m].median_speedup or 0 for m in methods]
        ax.bar([j + i * width for j in range(len(methods))], vals, width=width, label=suite)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(methods))], methods, rotation=30, ha="right", fontsize="small")
    ax.set(ylabel="median per-prompt speedup", title="greedy wall clock vs plain generate")
    ax.legend(fontsize="x-small")
    return _save(fig, out_dir / "wall_clock_speedup.png")


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return str(path)


def write_report(result: BenchResult, raw: dict, out_dir: str | os.PathLike, drafters: dict) -> Path:
    """Write ``benchmarks.json``, ``benchmarks.md`` and the PNGs into ``out_dir`` (``result.plots`` is set to
    the PNGs' names); returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.plots = write_plots(result, raw, out, drafters)
    (out / "benchmarks.md").write_text(markdown_report(result) + "\n")
    path = out / "benchmarks.json"
    path.write_text(result.dumps())
    return path

