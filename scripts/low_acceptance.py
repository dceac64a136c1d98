"""Select the bench's ``low-accept`` suite: the held-out chat prompts on which the drafter accepts least (issue #28).

Runs the shipped drafter in the fixed mode (every round verifies all γ drafts, DSpark alone: lookup off), greedy,
on the first ``--pool`` held-out chat prompts of ``dspark bench`` (test split, never trained, validated or
calibrated on; at most 320 chat-formatted tokens), ranks them by greedy τ and prints the ``--keep`` lowest as the
``LOW_ACCEPTANCE_IDS`` tuple of :mod:`dspark_hf.bench.suites`; ``--out`` writes every prompt's τ as JSON:

    flock /tmp/cpu.lock python scripts/low_acceptance.py --pool 40 --keep 12 --out docs/floor/low_acceptance.json

The τ of a fixed-length round depends only on the drafter and the target (greedy), not on the machine's speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dspark_hf import DSparkDrafter
from dspark_hf.bench.settings import BenchSettings
from dspark_hf.bench.suites import encode_suites, suite_texts
from dspark_hf.defaults import default_drafter
from dspark_hf.evaluation.runs import timed_generate
from dspark_hf.runtime.targets import load_default_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", type=int, default=40, help="held-out chat prompts scored (default 40)")
    parser.add_argument("--keep", type=int, default=12, help="prompts kept, lowest τ first (default 12)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per prompt (default 48)")
    parser.add_argument("--out", type=Path, help="write every scored prompt's τ here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_default_target()
    drafter = DSparkDrafter.from_pretrained(default_drafter())
    suites, _ = encode_suites(tokenizer, suite_texts(["chat"]), args.pool, BenchSettings.max_prompt_tokens)
    scored = []
    for record_id, ids in suites["chat"]:
        run = timed_generate(target, ids, args.max_new_tokens, drafter=drafter, dspark_verification="fixed",
                             dspark_lookup=False)
        scored.append({"id": record_id, "tau": run.stats.tau, "rounds": len(run.stats.rounds)})
        print(f"{record_id}: τ {run.stats.tau:.3f}", flush=True)
    scored.sort(key=lambda r: (r["tau"], r["id"]))
    kept = [r["id"] for r in scored[: args.keep]]
    print("LOW_ACCEPTANCE_IDS = (" + ", ".join(repr(i) for i in kept) + ")")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"pool": args.pool, "keep": args.keep, "max_new_tokens": args.max_new_tokens,
                                        "kept": kept, "scored": scored}, indent=2) + "\n")


if __name__ == "__main__":
    main()
