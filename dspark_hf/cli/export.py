"""``dspark export``: a v2 drafter as a speculators (vLLM) or DeepSpec (SGLang, SpecForge) checkpoint."""

from __future__ import annotations

import sys

from .common import add_command

NAME = "export"
HELP = "write a v2 drafter as a speculators (vLLM) or DeepSpec (SGLang, SpecForge) checkpoint"


def run(args):
    from ..hub.export import export_drafter
    from ..modeling.modeling_dspark import DSparkDrafter

    drafter = DSparkDrafter.from_pretrained(args.drafter_dir)
    if args.format == "speculators" and drafter.config.draft_vocab_size:  # stores the target's lm_head rows
        from transformers import AutoModelForCausalLM

        from ..runtime.targets import load_default_target

        target = load_default_target(prepack=False)[0] if args.target is None else AutoModelForCausalLM.from_pretrained(args.target)
        drafter.bind(target)
    try:  # a v1 drafter, or one the format cannot hold exactly: the message names the fix
        out = export_drafter(drafter, args.out, args.format, verifier_name_or_path=args.verifier)
    except ValueError as err:
        sys.exit(f"dspark export: {err}")
    print(f"{args.format} checkpoint written to {out}")


def add_parser(sub):
    p = add_command(sub, NAME, run, HELP)
    p.add_argument("drafter_dir", help="dspark-hf drafter folder or Hub id")
    p.add_argument("--format", choices=("speculators", "deepspec"), required=True,
                   help="speculators: vLLM; deepspec: SGLang and SpecForge")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--verifier", default=None,
                   help="speculators: the verifier's Hub id or folder the engine loads (default: the drafter's target_name_or_path)")
    return p
