"""``dspark push``: upload a drafter folder (with its card) to the Hugging Face Hub."""

from __future__ import annotations

import sys

from .common import add_command

NAME = "push"
HELP = "upload a drafter folder (with its card) to the Hugging Face Hub"


def run(args):
    from ..hub.push import HubTokenError, push

    try:
        info = push(args.model_dir, args.repo_id, private=args.private)
    except (HubTokenError, FileNotFoundError, ValueError) as err:
        sys.exit(str(err))
    print(f"pushed {args.model_dir} to {getattr(info, 'commit_url', None) or args.repo_id}")


def add_parser(sub):
    p = add_command(sub, NAME, run, HELP)
    p.add_argument("model_dir", help="the drafter folder, with the card `dspark card` wrote")
    p.add_argument("--repo-id", required=True, help="ORG/NAME")
    p.add_argument("--private", action="store_true",
                   help="create the repo private (an existing repo keeps its visibility)")
    return p
