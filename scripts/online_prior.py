"""Choose the online correction's prior pseudo-count m (``calibration.ONLINE_PRIOR``) on recorded rounds (issue #28).

Records the shipped drafter's greedy fixed-length rounds (γ = 7, DSpark alone: lookup off) on the bench's held-out
prompts (the ``low-accept`` set at 64 new tokens; code / chat / math at 96), then replays every prompt's rounds for
each candidate m: each round's verified positions are predicted by ``c'' = min(1, f · c')`` with ``f`` learnt from
the EARLIER rounds of the same generation only, as :class:`~dspark_hf.decoding.calibration.OnlineCorrection` runs,
and scored against what the target accepted (mean Brier score and log loss per verified position). ``--basis
previous`` predicts from the previous block's confidences, as the round planner of ``async`` + lookup does.

    flock /tmp/cpu.lock python scripts/online_prior.py --rounds /tmp/rounds.json   # records, then scores
    python scripts/online_prior.py --rounds /tmp/rounds.json --basis previous       # scores the saved rounds

Greedy rounds depend only on the drafter and the target, not on the machine's speed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from dspark_hf import DSparkDrafter
from dspark_hf.bench.settings import BenchSettings
from dspark_hf.bench.suites import encode_suites, suite_texts
from dspark_hf.decoding.calibration import OnlineCorrection, SequentialTemperatureScaling
from dspark_hf.defaults import default_drafter
from dspark_hf.evaluation.runs import timed_generate
from dspark_hf.runtime.targets import load_default_target

PRIORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
SUITES = ((("low-accept",), 12, 64), (("code", "chat", "math"), 12, 96))  # (suites, prompts each, new tokens)


def record(path: Path) -> dict:
    """Every prompt's greedy fixed rounds, ``{"temperatures", "prompts": [{"suite", "id", "rounds": [[raw c (γ,),
    ℓ, accepted], ...]}]}``, written to ``path`` as JSON."""
    target, tokenizer = load_default_target()
    drafter = DSparkDrafter.from_pretrained(default_drafter())
    out = {"temperatures": drafter.calibration.temperatures, "prompts": []}
    for names, limit, tokens in SUITES:
        suites, _ = encode_suites(tokenizer, suite_texts(list(names)), limit, BenchSettings.max_prompt_tokens)
        for suite in names:
            for record_id, ids in suites[suite]:
                run = timed_generate(target, ids, tokens, drafter=drafter, dspark_verification="fixed",
                                     dspark_block_size=7, dspark_lookup=False)
                rounds = [[r.confidences, r.scheduled, r.accepted] for r in run.stats.rounds if r.confidences]
                out["prompts"].append({"suite": suite, "id": record_id, "rounds": rounds})
                print(f"{suite} {record_id}: τ {run.stats.tau:.3f}", flush=True)
    path.write_text(json.dumps(out))
    return out


def score(data: dict, prior: float, previous: bool, first_rounds: int | None) -> dict[str, tuple[float, float, int]]:
    """``{group: (Brier, log loss, positions)}`` of the corrected predictions with pseudo-count ``prior``, over
    rounds ``2..first_rounds + 1`` of each prompt (``None``: all); groups ``low-accept`` and ``others``."""
    sts = SequentialTemperatureScaling(temperatures=data["temperatures"])
    sums: dict[str, list[float]] = {}
    for prompt in data["prompts"]:
        group = sums.setdefault("low-accept" if prompt["suite"] == "low-accept" else "others", [0.0, 0.0, 0])
        correction, last = OnlineCorrection(prior), None
        for index, (raw, scheduled, accepted) in enumerate(prompt["rounds"]):
            calibrated = sts.apply(torch.tensor(raw, dtype=torch.float64)).tolist()
            basis = last if previous else calibrated
            if basis is not None and index >= 1 and (first_rounds is None or index <= first_rounds):
                predicted = correction.apply(basis)
                for k in range(min(accepted + 1, scheduled)):  # the verified positions the target reached
                    q, y = min(max(predicted[k], 1e-4), 1 - 1e-4), float(k < accepted)
                    group[0] += (q - y) ** 2
                    group[1] -= y * math.log(q) + (1 - y) * math.log(1 - q)
                    group[2] += 1
            correction.observe(calibrated[:scheduled], accepted)
            last = calibrated
    return {g: (b / n, ll / n, n) for g, (b, ll, n) in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=Path, required=True, help="recorded rounds (JSON): read if it exists, else "
                        "recorded and written there")
    parser.add_argument("--basis", choices=("own", "previous"), default="own",
                        help="predict a round from its own block's confidences or the previous block's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = json.loads(args.rounds.read_text()) if args.rounds.exists() else record(args.rounds)
    for first_rounds, label in ((2, "rounds 2-3"), (None, "every round after the first")):
        print(f"\n{label} ({args.basis} block): Brier / log loss per verified position")
        for prior in PRIORS:
            cells = score(data, prior, args.basis == "previous", first_rounds)
            print(f"m = {prior:<5g}" + "".join(f"  {g}: {b:.4f} / {ll:.4f} (n = {n})" for g, (b, ll, n) in cells.items()))


if __name__ == "__main__":
    main()
