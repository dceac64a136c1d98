"""``dspark train``: regenerate data with the target and train a drafter (GPU through accelerate where there is one)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import fields

from ..defaults import DEFAULT_TRAIN_CONFIG
from .common import add_command, dataclass_flags

NAME = "train"
EXTRA = "train"  # the optional dependencies it needs (pyproject.toml); dspark_hf.cli.main checks them first
HELP = ("regenerate data with the target and train a drafter (on a GPU where there is one; several processes: "
        "`accelerate launch -m dspark_hf.cli train`)")


def run(args):
    from accelerate import PartialState

    from ..modeling.configuration_dspark import spread_layer_ids
    from ..runtime.targets import load_target
    from ..training.config import TrainConfig
    from ..training.data import prepare_data
    from ..training.trainer import train

    cfg = TrainConfig.from_yaml(args.config, **config_overrides(args))
    if args.export_tokens:
        from ..training.data import export_tokens

        if not cfg.tokens_file:
            sys.exit(f"--export-tokens writes the config's tokens_file, and {args.config} sets none.")
        data_dir = cfg.data_dir[0]
        print(f"{export_tokens(data_dir, cfg.tokens_file)} rows of {data_dir} written to {cfg.tokens_file}")
        return
    import torch

    if cfg.threads:  # regeneration and training alike: pinned threads hold up when the machine is shared
        torch.set_num_threads(cfg.threads)
    # this process of `accelerate launch` / torchrun, or the only one: cuda:LOCAL_RANK where there are GPUs, else
    # the CPU (accelerate runs several processes on the CPU only when told cpu=True)
    state = PartialState(cpu=not torch.cuda.is_available())
    target, tokenizer = load_target(args.target, stock_kernels=state.device.type != "cpu", threads=None)  # cfg.threads
    target.to(state.device)
    if state.is_main_process and not args.train_only:  # one (resumable) regeneration; the others wait for its data
        layers = spread_layer_ids(target.config.num_hidden_layers, cfg.num_context_layers)
        prepare_data(target, tokenizer, cfg.data_dir[0], layers, cfg.target_tokens, cfg.gen_batch_size,
                     max_new_tokens=cfg.max_new_tokens, worker=args.worker, tokens_file=cfg.tokens_file, replies=cfg.replies,
                     prompts=dict(turns=cfg.turns, max_prompt_tokens=cfg.max_prompt_tokens))
    state.wait_for_everyone()
    if args.prepare_only:
        return
    final = train(target, cfg, command=shlex.join(["dspark", *args.argv]))  # the flags too: they override the file
    if state.is_main_process:
        print(f"drafter saved to {final}")


def _worker(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``0 <= K < N``."""
    try:
        index, workers = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--worker takes K/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= index < workers:
        raise argparse.ArgumentTypeError(f"--worker K/N needs 0 <= K < N, got {text!r}")
    return index, workers


def config_overrides(args) -> dict:
    """The :class:`~dspark_hf.training.config.TrainConfig` fields given as flags (they override the YAML)."""
    from ..training.config import TrainConfig

    return {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}


def add_parser(sub):
    """``dspark train --config FILE``, plus every :class:`~dspark_hf.training.config.TrainConfig` field as a flag
    (``HfArgumentParser``: ``--lr 1e-3``, ``--max-minutes 30``...) that overrides the file."""
    from ..training.config import TrainConfig

    config = dataclass_flags(TrainConfig)  # absent unless given: the YAML value stays
    for action in config._actions:
        if action.dest == "loss_weights":
            action.type = json.loads  # --loss-weights '{"ce": 1.0, "tv": 0.0, "conf": 1.0}'
    p = add_command(sub, NAME, run, HELP, parents=[config])
    p.add_argument("--config", default=str(DEFAULT_TRAIN_CONFIG), help="training config YAML (default: the shipped drafter's)")
    p.add_argument("--prepare-only", action="store_true", help="only generate and cache the training data")
    p.add_argument("--train-only", action="store_true", help="train on the data already cached in the data_dir folders (no regeneration)")
    p.add_argument("--export-tokens", action="store_true",
                   help="write the token ids of the first data_dir's shards to the config's tokens_file (to commit) and exit")
    p.add_argument("--worker", type=_worker, default=(0, 1), metavar="K/N",
                   help="regenerate only shards i with i %% N == K, so N processes can share the work (default 0/1)")
    return p
