"""Learning curves of drafter training runs: validation greedy τ and k = 1 survival against draft positions trained.

Reads each run's ``log.jsonl`` (written by ``dspark train``) and its ``train_config.yaml``; positions trained per
step = sequences_per_step × anchors_per_sequence × block_size. Writes a PNG (log-scale x) and prints a table.

    python scripts/learning_curve.py runs/exp/e1-paper runs/exp/e2-ce1 --out docs/learning_curve.png
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402


def curve(run: Path) -> list[tuple[int, float, float]]:
    """``[(positions trained, greedy τ, k = 1 greedy survival)]`` at each validation of ``run``."""
    cfg = yaml.safe_load((run / "train_config.yaml").read_text())
    per_step = cfg["sequences_per_step"] * cfg["anchors_per_sequence"] * cfg["block_size"]
    points = []
    for line in (run / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        val = record.get("validation")
        if val and "greedy_survival" in val:
            points.append((record["step"] * per_step, val["greedy_tau"], val["greedy_survival"][0]))
    return points


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
