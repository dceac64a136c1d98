"""``dspark profile``: the target's SPS curve (cached, or measured again), as a table, a PNG or an engine's cost table."""

from __future__ import annotations

import json
from pathlib import Path

from ..defaults import default_drafter
from .common import add_command, load_cli_target

NAME = "profile"
HELP = "measure (or show the cached) SPS curve of the target: table + PNG"


def default_max_tokens() -> int:
    """``γ + 1`` of the shipped drafter (what its scheduler reads of the SPS curve), else 8."""
    config = default_drafter() / "config.json"
    return json.loads(config.read_text())["block_size"] + 1 if config.is_file() else 8


def stored_max_tokens(path: Path) -> int:
    """The largest ``B`` to measure without ``--max-tokens``: :func:`default_max_tokens`, or more where the stored
    curve at ``path`` covers more (a batch or the concurrent engine extended it), so ``--refresh`` keeps its sizes."""
    from ..runtime.sps import SPSCurve

    stored = SPSCurve.from_json(path.read_text()).max_tokens if path.is_file() else 0
    return max(default_max_tokens(), stored)


def run(args):
    from ..runtime.profiling import load_or_profile_sps, profile_sps, sps_cache_path
    from ..runtime.sps import DEFAULT_CONTEXTS, plot_sps
    from ..runtime.tuning import forget_choices

    if args.refresh:  # before loading: the target's kernel choices are timed (or read) as it loads
        forget_choices()
    target, _ = load_cli_target(args)
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else DEFAULT_CONTEXTS
    path = sps_cache_path(target, args.context_len)
    kwargs = dict(max_tokens=args.max_tokens or stored_max_tokens(path), context_len=args.context_len,
                  contexts=contexts, time_budget_s=args.time_budget)
    if args.refresh:  # profile_sps replaces the cached file
        curve = profile_sps(target, **kwargs)
    else:
        curve = load_or_profile_sps(target, **kwargs)
    if args.engine_table:
        Path(args.out).write_text(json.dumps(curve.engine_table(args.engine_table), indent=2) + "\n")
        print(f"{args.engine_table} cost table ({curve.max_tokens} sizes, {curve.device_name}) written to {args.out}")
        return
    if args.json:
        print(curve.to_json())
        return
    try:
        png = plot_sps(curve, Path(args.png) if args.png else path.with_suffix(".png"))
    except ModuleNotFoundError:  # matplotlib is an extra: the table is the answer, the plot a bonus
        from ..defaults import install_hint

        png = f"not drawn: matplotlib is missing ({install_hint('data')})"
    print(f"SPS curve of {curve.target_name or 'the target'} on {curve.device_name}, {curve.linear_kernels} kernels "
          f"(ms per verification of B tokens; {curve.observations} online refinements):")
    print(curve.table())
    print(f"cached: {path}\nplot:   {png}")


def add_parser(sub):
    p = add_command(sub, NAME, run, HELP, kernels=True, compute=True)
    p.add_argument("--refresh", action="store_true",
                   help="measure again (e.g. on a quiet machine): the kernel choices at this thread count, then the "
                        "curve, replacing the stored ones")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="largest B (default: the shipped drafter's γ + 1, or the stored curve's largest B if more)")
    p.add_argument("--context-len", type=int, default=256, help="context of the primary row (part of the cache key)")
    p.add_argument("--contexts", default=None,
                   help="comma-separated context lengths, one row each (default: 256,1024,2048,4096 where they fit)")
    p.add_argument("--time-budget", type=float, default=25.0, help="seconds for the whole measurement (default 25)")
    p.add_argument("--png", default=None, help="where to write the plot (default: next to the cached JSON)")
    p.add_argument("--json", action="store_true", help="print the curve as JSON")
    p.add_argument("--engine-table", choices=("sglang", "tensorrt-llm"), default=None,
                   help="write the curve as that engine's cost table (SGLang: --speculative-dspark-sps-table-path) to --out")
    p.add_argument("--out", default="sps_table.json", help="file for --engine-table")
    return p
