"""``dspark bench``: τ, position-wise acceptance, calibration, threshold sweep and wall-clock speedup against peers."""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from ..defaults import DEFAULT_BENCH_DRAFTERS
from .common import _int_in, add_command, dataclass_flags, load_cli_target

if TYPE_CHECKING:
    from ..bench.settings import BenchSettings

NAME = "bench"
EXTRA = "data"  # the optional dependencies it needs (pyproject.toml); dspark_hf.cli.main checks them first
HELP = "τ, acceptance, confidence and wall-clock benchmarks (JSON, Markdown, PNG)"

QUICK_MAX_NEW_TOKENS = 32  # new tokens per generation of a quick run (``--limit`` without ``--max-new-tokens``)


def settings_from_args(args) -> tuple[BenchSettings, list[str]]:
    """:class:`BenchSettings` of ``dspark bench`` flags, and the notes they call for.

    ``--limit N`` asks for a quick run: unless ``--max-new-tokens`` is given too, each generation stops at
    :data:`QUICK_MAX_NEW_TOKENS` new tokens (``--limit 3`` then takes ~4 min on 2 CPU cores instead of ~8).

    Raises:
        ValueError: from :class:`BenchSettings` for a non-positive γ, limit or token budget.
    """
    from ..bench.settings import BenchSettings

    given = {f.name: getattr(args, f.name) for f in fields(BenchSettings) if hasattr(args, f.name)}  # flags given
    quick = "limit" in given and "max_new_tokens" not in given
    if quick:
        given["max_new_tokens"] = QUICK_MAX_NEW_TOKENS
    settings = BenchSettings(**given)
    full = BenchSettings.__dataclass_fields__["max_new_tokens"].default
    notes = [f"Quick run (--limit): {settings.max_new_tokens} new tokens per generation; add --max-new-tokens "
             f"{full} for the full-length protocol."] if quick else []
    return settings, notes


def run(args):
    from ..bench.concurrency import check_arms
    from ..bench.loading import load_drafters, parse_drafters
    from ..bench.report import markdown_report, write_report
    from ..bench.runner import run_bench
    from ..bench.suites import LONG_TOKENS, SUITES, encode_suites, suite_texts
    from ..evaluation.tables import counted

    started = time.perf_counter()
    try:
        settings, notes = settings_from_args(args)
        spec = parse_drafters(args.drafters)
        check_arms(args.concurrency_arms, args.concurrency_paired or args.concurrency_lockstep)  # --concurrency-arms
        if args.concurrency_paired and args.concurrency_lockstep:
            raise ValueError("--concurrency-paired and --concurrency-lockstep are two protocols; choose one")
    except ValueError as err:  # before the target loads: a typo costs nothing
        sys.exit(f"dspark bench: {err}")
    if args.concurrency_repeats < 1:
        sys.exit(f"dspark bench: --concurrency-repeats must be >= 1, got {args.concurrency_repeats}")
    names = args.suites.split(",") if args.suites else (["custom"] if args.prompts else list(SUITES))
    if args.prompts and "custom" not in names:
        names.append("custom")
    target, tokenizer = load_cli_target(args)
    drafters, sources, loading_notes = load_drafters(spec, target, settings.gamma)
    notes += loading_notes
    if not drafters:
        sys.exit("No drafter found; pass --drafters name=PATH,... (see `dspark bench --help`).")
    suites, skipped = encode_suites(tokenizer, suite_texts(names, args.prompts), settings.limit, settings.max_prompt_tokens)
    for name, n in skipped.items():
        if n:
            window = "outside {}-{} tokens".format(*LONG_TOKENS) if name == "long" else f"longer than {settings.max_prompt_tokens} tokens"
            notes.append(f"suite {name!r}: {counted(n, 'prompt')} {window} skipped.")
        if len(suites[name]) < settings.limit:
            notes.append(f"suite {name!r} has only {counted(len(suites[name]), 'prompt')} (limit {settings.limit}).")
    empty = [n for n, p in suites.items() if not p]
    if empty:
        sys.exit(f"Suites without prompts: {empty}")
    if args.concurrency:
        return _run_concurrency(args, target, drafters, suites, settings, notes)
    result, raw = run_bench(target, drafters, suites, settings, notes=notes, builtin_dflash=not args.no_builtin_dflash,
                            command=shlex.join(["dspark", *sys.argv[1:]]), sources=sources)
    result.runtime_s = time.perf_counter() - started  # loading included
    if args.out:
        path = write_report(result, raw, args.out, drafters)
        print(f"wrote {path}, {Path(args.out) / 'benchmarks.md'} and {counted(len(result.plots), 'plot')}", file=sys.stderr)
    if args.json:
        print(result.dumps(), end="")
    elif not args.out:
        print(markdown_report(result))


def _run_concurrency(args, target, drafters, suites, settings, notes: list[str]):
    """``--concurrency``: the many-requests bench (:mod:`dspark_hf.bench.concurrency`) with the first drafter, on
    the suites' prompts taken in turn (one of each suite, then the next of each, ...; a shorter suite drops out).
    The run's ``notes`` go to stderr first and into ``concurrency.json`` / ``.md`` (and the table printed)."""
    from ..bench.concurrency import markdown, run_concurrency, write

    name, drafter = next(iter(drafters.items()))
    queues = [[ids for _, ids in pairs] for pairs in suites.values()]
    prompts = [queue[i] for i in range(max(map(len, queues))) for queue in queues if i < len(queue)]
    result = run_concurrency(target, drafter, [list(map(int, p)) for p in prompts], args.concurrency,
                             settings.max_new_tokens, settings.gamma, arms=args.concurrency_arms,
                             log=lambda line: print(line, file=sys.stderr), repeats=args.concurrency_repeats,
                             paired=args.concurrency_paired, lockstep=args.concurrency_lockstep, notes=notes)
    result["settings"].update(drafter=name, command=shlex.join(["dspark", *sys.argv[1:]]))
    if args.out:
        paths = write(result, args.out)
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    print(markdown(result))


def _levels(text: str) -> list[int]:
    """argparse type of ``--concurrency``: comma-separated concurrency levels R, each an integer >= 1 (checked while
    the flags are parsed, before anything loads)."""
    return [_int_in(1)(level) for level in text.split(",")]


def add_parser(sub):
    """``dspark bench``: :class:`~dspark_hf.bench.runner.BenchSettings` fields as flags (``HfArgumentParser``), plus
    what to run on and where to write; a settings flag that is not given leaves the dataclass default."""
    from ..bench.concurrency import ARMS, REPEATS
    from ..bench.settings import BenchSettings
    from ..bench.suites import OTHER_SUITES, SUITES

    settings = dataclass_flags(BenchSettings)  # absent unless given: --limit alone means a quick run
    p = add_command(sub, NAME, run, HELP, kernels=True, compute=True, parents=[settings])
    p.add_argument("--drafters", default=DEFAULT_BENCH_DRAFTERS,
                   help="name=PATH,... (missing folders are skipped with a note); names 'dspark' and 'dflash' "
                        f"give tau_ratio_dspark_over_dflash (default: {DEFAULT_BENCH_DRAFTERS})")
    p.add_argument("--suites", default=None, help=f"comma-separated subset of {','.join(SUITES + OTHER_SUITES)} "
                                                  "(default: code,chat,math, or only custom with --prompts)")
    p.add_argument("--prompts", default=None, help="JSONL file, one {\"prompt\": ...} per line: the 'custom' suite")
    p.add_argument("--no-builtin-dflash", action="store_true", help="skip the built-in speculation_type='dflash' path")
    p.add_argument("--out", default=None, help="folder for benchmarks.json, benchmarks.md and the PNGs (e.g. docs)")
    p.add_argument("--json", action="store_true", help="print the JSON to stdout")
    p.add_argument("--concurrency", default=None, type=_levels,
                   help="comma-separated R, e.g. 1,2,4,8: instead of the single-request bench, serve 2·R prompts with R "
                        "in flight through plain batched decoding, fixed γ, the best fixed k per R, threshold, "
                        "Algorithm 1 and async (concurrency.json/.md and two PNGs in --out); with fewer prompts "
                        "than 2·R (--limit per suite) the prompts repeat in turn")
    p.add_argument("--concurrency-repeats", type=int, default=REPEATS,
                   help=f"with --concurrency: timed closed loops per arm and R, interleaved, the fastest reported "
                        f"(default {REPEATS}; 5 or more with --concurrency-paired)")
    p.add_argument("--concurrency-arms", default=ARMS, type=lambda text: tuple(text.split(",")),
                   help=f"with --concurrency: the arms to run, comma-separated (default {','.join(ARMS)})")
    p.add_argument("--concurrency-paired", action="store_true",
                   help="with --concurrency: run plain batched decoding before every other closed loop and once at the "
                        "end, the others rotated each repetition, and report each arm's median ratio to the plain runs "
                        "adjacent in time (and its range): the comparison a machine whose speed drifts from minute to "
                        "minute still supports; about twice the closed loops (and time) of the default order")
    p.add_argument("--concurrency-lockstep", action="store_true",
                   help="with --concurrency: run every closed loop other than plain in lockstep with a plain closed "
                        "loop of its own (one step of each in turn, each timed on its own steps: "
                        "dspark_hf.bench.lockstep) and report each arm's median ratio to its partner (and its range): "
                        "machine drift hits both loops alike; about the time of the paired protocol")
    return p
