"""Median wall-clock speedup of ``dspark generate --compare`` on held-out ShareGPT prompts (issue #4).

Runs the CLI once per prompt and verification mode, exactly as a user would, and writes the per-prompt
records and the medians as JSON:

    python scripts/compare_generate.py --n 10 --modes scheduler,async --threads 2 --out docs/compare.json

Prompts: the first ``n`` chat prompts of the held-out ``test`` split (conversations never trained,
validated or calibrated on) whose chat-formatted ids fit 320 tokens, as in ``dspark bench``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from dspark_hf.bench.settings import BenchSettings
from dspark_hf.bench.suites import encode_suites, suite_texts
from dspark_hf.runtime.targets import load_default_target


def held_out_prompts(n: int) -> list[tuple[str, str]]:
    """``(record_id, prompt text)`` of the first ``n`` held-out chat prompts that fit the length limit."""
    _, tokenizer = load_default_target()
    texts = suite_texts(["chat"])
    encoded, _ = encode_suites(tokenizer, texts, n, BenchSettings.max_prompt_tokens)
    kept = {record_id for record_id, _ in encoded["chat"]}
    return [(record_id, text) for record_id, text in texts["chat"] if record_id in kept]


def compare(prompt: str, mode: str, max_new_tokens: int, drafter: str | None, device: str = "cpu",
            threads: int = 1) -> dict:
    """One ``dspark generate --compare --json`` run (greedy), by this interpreter, with ``threads`` torch threads."""
    command = [sys.executable, "-m", "dspark_hf.cli", "generate", prompt, "--compare", "--json", "--verify", mode,
               "--max-new-tokens", str(max_new_tokens), "--device", device, "--threads", str(threads)]
    command += ["--drafter", drafter] if drafter else []
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--modes", default="scheduler")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", default=None, help="default: the shipped drafter")
    parser.add_argument("--device", default="cpu", help="e.g. cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of each run (as dspark generate)")
    parser.add_argument("--out", default="docs/compare.json")
    args = parser.parse_args(argv)
    prompts = held_out_prompts(args.n)
    result = {"command": " ".join(["python", *sys.argv]), "modes": {}}
    for mode in args.modes.split(","):
        runs = []
        for record_id, text in prompts:
            run = {"id": record_id} | {k: v for k, v in compare(text, mode, args.max_new_tokens, args.drafter, args.device, args.threads).items() if k != "text"}
            print(json.dumps(run), flush=True)
            runs.append(run)
        result["modes"][mode] = {
            "median_speedup": statistics.median(r["speedup"] for r in runs),
            "median_tau": statistics.median(r["tau"] for r in runs),
            "identical": sum(bool(r["identical"]) for r in runs),
            "prompts": len(runs),
            "runs": runs,
        }
        print(mode, {k: v for k, v in result["modes"][mode].items() if k != "runs"}, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
