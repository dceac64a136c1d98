"""``dspark calibrate``: fit Sequential Temperature Scaling on calibration rounds; writes ``calibration.json`` and ``reliability.png``."""

from __future__ import annotations

import json
from pathlib import Path

from ..defaults import default_drafter
from .common import _int_in, _temperature, add_command, load_models

NAME = "calibrate"
EXTRA = "data"  # the optional dependencies it needs (pyproject.toml); dspark_hf.cli.main checks them first
HELP = "fit Sequential Temperature Scaling (STS) on calibration rounds: calibration.json, reliability.png"


def run(args):
    from ..decoding.calibration import SequentialTemperatureScaling, reliability_diagram
    from ..evaluation.runs import collect_rounds
    from ..sources.prompt_queue import sharegpt_queue

    target, tokenizer, drafter = load_models(args)
    prompts = [ids for _, _, ids in sharegpt_queue(tokenizer, ("calibration",))[: args.prompts]]
    confs, accepted, _ = collect_rounds(target, drafter, prompts, args.max_new_tokens, args.temperature)
    sts = SequentialTemperatureScaling().fit(confs, accepted)
    out = Path(args.drafter or default_drafter())
    sts.save(out)
    reliability_diagram(confs, accepted, sts, out / "reliability.png")
    report = sts.fit_report
    print(json.dumps({"rounds": report["n_rounds"], "ece_before": report["mean_ece_before"],
                      "ece_after": report["mean_ece_after"], "temperatures": sts.temperatures}, indent=2))


def add_parser(sub):
    p = add_command(sub, NAME, run, HELP, drafter=True, compute=True)
    p.add_argument("--prompts", type=_int_in(1), default=40, help="held-out ShareGPT prompts to collect rounds from (default 40)")
    p.add_argument("--max-new-tokens", type=_int_in(1), default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default); > 0 samples at that temperature")
    return p
