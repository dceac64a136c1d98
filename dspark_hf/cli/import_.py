"""``dspark import``: a speculators or DeepSpec DSpark checkpoint as a dspark-hf drafter folder."""

from __future__ import annotations

from .common import add_command

NAME = "import"
HELP = "convert a speculators or DeepSpec DSpark checkpoint into a dspark-hf drafter folder"


def run(args):
    from ..modeling.modeling_dspark import DSparkDrafter

    drafter = DSparkDrafter.from_pretrained(args.checkpoint)
    drafter.save_pretrained(args.out)
    print(f"dspark-hf drafter written to {args.out} (sequential head {drafter.config.sequential_head!r}, "
          f"draft vocabulary {drafter.config.draft_vocab_size or 'full'}, verification {drafter.config.verification!r})")


def add_parser(sub):
    p = add_command(sub, NAME, run, HELP)
    p.add_argument("checkpoint", help="checkpoint folder or Hub id")
    p.add_argument("--out", required=True, help="output folder (loadable with DSparkDrafter.from_pretrained)")
    return p
