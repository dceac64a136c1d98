"""The ``dspark`` command line: info, generate, profile, train, calibrate, export, import, bench, card, push, demo.

Each command is one module of this package with ``NAME``, ``HELP``, ``add_parser(sub)`` and ``run(args)``; this module
only assembles them, applies ``--threads`` and prints warnings as one line each (no source line: a user of the
command reads the message, not our code).

Start-up is cheap: the command modules import torch, transformers and the rest of the package inside ``run`` (or, for
the flags made from settings dataclasses, inside ``add_parser``), only the chosen command's parser is built in full
(the others are listed by name and ``HELP``), and the package is wired (:func:`dspark_hf.wire`: Auto classes,
drafter extensions, ``generate`` routing) only once a command runs. So ``dspark --help``, ``--version`` and argument
errors print before torch is imported.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from ..defaults import __version__, install_hint, missing_extra
from . import bench, calibrate, card, demo, export, generate, import_, info, profile, push, train

COMMANDS = (info, generate, profile, train, calibrate, export, import_, bench, card, push, demo)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"{category.__name__}: {message}\n"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The ``dspark`` parser for ``argv``: the command it names (its first word) in full, the others by name and
    ``HELP`` only (what ``dspark --help`` lists)."""
    chosen = next((a for a in argv if not a.startswith("-")), None)
    return _parser(lambda command: command.NAME == chosen)


def full_parser() -> argparse.ArgumentParser:
    """The ``dspark`` parser with every command's parser built in full (what ``--help`` of each command shows)."""
    return _parser(lambda command: True)


def _parser(in_full) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding for 🤗 Transformers. "
                                     "`dspark COMMAND --help` lists the options of a command.")
    parser.add_argument("--version", action="version", version=f"dspark-hf {__version__}",
                        help="print the version of dspark-hf and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        if in_full(command):
            command.add_parser(sub)
        else:
            sub.add_parser(command.NAME, help=command.HELP)
    return parser


def check_extra(command) -> None:
    """Exit with the install command when ``command.EXTRA`` (its optional dependencies, pyproject.toml) is missing."""
    extra = getattr(command, "EXTRA", None)
    missing = missing_extra(extra) if extra else []
    if missing:
        sys.exit(f"dspark {command.NAME} needs dspark-hf's '{extra}' extra, and {', '.join(missing)} "
                 f"{'is' if len(missing) == 1 else 'are'} not installed: {install_hint(extra)}")


def main(argv=None):
    """Entry point of the ``dspark`` console script."""
    warnings.formatwarning = _one_line_warning
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # as typed (training.json records it)
    if getattr(args, "threads", None) is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    check_extra(next(c for c in COMMANDS if c.NAME == args.command))
    from .. import wire  # Auto classes, drafter extensions, generate routing: this is where torch loads

    wire()
    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)
    args.fn(args)


if __name__ == "__main__":
    main()
