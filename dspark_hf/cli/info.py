"""``dspark info``: versions, default target, drafter and cache paths."""

from __future__ import annotations

import json

from ..defaults import default_drafter
from .common import add_command

NAME = "info"
HELP = "versions, default target and drafter, cache paths"


def run(args):
    from ..defaults import DEFAULT_TARGET_NAME, __version__, cache_root, default_target_dir, default_target_gguf
    from ..runtime.machine import describe_machine

    try:
        gguf = str(default_target_gguf())
    except (ModuleNotFoundError, FileNotFoundError) as err:
        gguf = f"missing ({err})"
    machine = describe_machine()
    info = {
        "dspark_hf": __version__,
        "transformers": machine.transformers,
        "torch": machine.torch,
        "python": machine.python,
        "device": machine.device,
        "default_target": DEFAULT_TARGET_NAME,
        "default_target_gguf": gguf,
        "default_target_cache": str(default_target_dir()),
        "cache_root": str(cache_root()),
        "default_drafter": str(drafter) if (drafter := default_drafter()).is_dir() else None,
    }
    print(json.dumps(info, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))


def add_parser(sub):
    p = add_command(sub, NAME, run, HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of one line per item")
    return p
