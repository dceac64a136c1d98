"""``dspark card``: write a drafter folder's model card, ``custom_generate/`` and remote code (its Hub repo)."""

from __future__ import annotations

import sys

from ..defaults import DEFAULT_BENCH, DEFAULT_COMPARE
from .common import add_command

NAME = "card"
HELP = "write the model card (README.md), custom_generate/ and the remote code into a drafter folder"


def run(args):
    from ..hub.card import write_card

    bench = args.bench if args.bench is not None else (DEFAULT_BENCH if DEFAULT_BENCH.is_file() else None)
    compare = args.compare if args.compare is not None else (DEFAULT_COMPARE if DEFAULT_COMPARE.is_file() else None)
    try:
        readme = write_card(args.model_dir, bench=bench, repo_id=args.repo_id, compare=compare)
    except (FileNotFoundError, ValueError) as err:  # a folder or record that is not ready: say what to run
        sys.exit(str(err))
    print(f"wrote {readme}")


def add_parser(sub):
    p = add_command(sub, NAME, run, HELP)
    p.add_argument("model_dir", help="the drafter folder (config.json, weights, calibration.json, training.json)")
    p.add_argument("--bench", default=None,
                   help="benchmark results JSON, e.g. from `dspark bench` (default: docs/benchmarks.json when present)")
    p.add_argument("--compare", default=None,
                   help="scripts/compare_generate.py results (default: docs/compare.json when present)")
    p.add_argument("--repo-id", default=None,
                   help="Hub id the folder will be pushed to (default: the one the card was last written for)")
    return p
