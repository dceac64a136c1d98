"""Learning curves of drafter training runs: validation greedy τ and k = 1 survival against draft positions trained.

Each argument is a run folder of ``dspark train`` (its ``log.jsonl`` and ``train_config.yaml``) or a drafter folder
whose ``training.json`` carries the curve (``dspark_hf.training.curve``: warm starts included, so the shipped
drafters' curves come with them). Writes a PNG (log-scale x) and prints a table.

    python scripts/learning_curve.py drafters/dspark-smollm2-135m-instruct ablations/* --out docs/learning_curve.png
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dspark_hf.training.config import TrainConfig  # noqa: E402
from dspark_hf.training.curve import run_curve  # noqa: E402


def curve(folder: Path) -> list[tuple[int, float, float]]:
    """``[(positions trained, greedy τ, k = 1 greedy survival)]`` at each validation of a run or drafter folder."""
    if (folder / "training.json").is_file():
        points = json.loads((folder / "training.json").read_text()).get("curve", [])
    else:
        cfg = TrainConfig.from_yaml(folder / "train_config.yaml")
        points = run_curve(folder / "log.jsonl", cfg)
    return [(p["positions"], p["greedy_tau"], p["greedy_survival_1"]) for p in points]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/learning_curve.png"))
    args = parser.parse_args()
    fig, (ax_tau, ax_k1) = plt.subplots(1, 2, figsize=(11, 4))
    for run in args.runs:
        points = [p for p in curve(run) if p[0] > 0]
        print(f"{run.name}: " + ", ".join(f"{n:,}: τ {t:.3f} k1 {k:.3f}" for n, t, k in points))
        ax_tau.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=run.name)
        ax_k1.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=run.name)
    for ax, label in ((ax_tau, "validation greedy τ (teacher-forced, γ = 7)"), (ax_k1, "validation P(draft 1 survives), greedy")):
        ax.set_xscale("log")
        ax.set_xlabel("draft positions trained")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_tau.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
