"""``dspark demo``: serve the Gradio demo (needs the ``demo`` extra)."""

from __future__ import annotations

import sys

from .common import add_command, load_models

NAME = "demo"
EXTRA = "demo"  # the optional dependencies it needs (pyproject.toml); dspark_hf.cli.main checks them first
HELP = "serve the Gradio demo at http://127.0.0.1:7860: live token colouring, stats, side-by-side"


def boolean(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) for ``--share``."""
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def run(args):
    """``dspark demo``: load the target and drafter, then serve the app."""
    try:
        import gradio  # noqa: F401
    except ModuleNotFoundError:
        from ..defaults import install_hint

        sys.exit(f"The demo needs Gradio: {install_hint('demo')}")
    from ..demo.app import launch

    target, tokenizer, drafter = load_models(args)
    launch(target, tokenizer, drafter, port=args.port, share=args.share, server_name=args.host)


def add_parser(sub):
    p = add_command(sub, NAME, run, HELP, drafter=True, compute=True)
    p.add_argument("--port", type=int, default=None, help="port (default: $GRADIO_SERVER_PORT, else 7860)")
    p.add_argument("--share", type=boolean, nargs="?", const=True, default=False, metavar="{true,false}",
                   help="create a public Gradio share link (needs network; default false)")
    p.add_argument("--host", default=None, help="interface to bind (default: $GRADIO_SERVER_NAME, else 127.0.0.1)")
    return p
