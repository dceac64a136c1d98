"""The ``dspark`` command line: info, generate, profile, train, calibrate, export, import, bench, card, push, demo.

Each command is one module of this package with ``add_parser(sub)`` and ``run(args)``; this module only assembles
them, applies ``--threads`` and prints warnings as one line each (no source line: a user of the command reads the
message, not our code).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from . import bench, calibrate, card, demo, export, generate, import_, info, profile, push, train

COMMANDS = (info, generate, profile, train, calibrate, export, import_, bench, card, push, demo)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"{category.__name__}: {message}\n"


def main(argv=None):
    """Entry point of the ``dspark`` console script."""
    warnings.formatwarning = _one_line_warning
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed (training.json records it)
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    args.fn(args)


if __name__ == "__main__":
    main()
