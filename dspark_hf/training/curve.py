"""The learning curve a drafter carries in its ``training.json``: validation greedy τ and P(draft 1 survives) against
draft positions trained, warm starts (``init_from``) included, so the curve outlives the run folder (issue #16)."""

from __future__ import annotations

import json
from pathlib import Path

from .config import TrainConfig


def positions_per_step(config: dict | TrainConfig) -> int:
    """Draft positions one optimizer step trains: ``sequences_per_step × anchors_per_sequence × block_size``."""
    values = config if isinstance(config, dict) else vars(config)
    return values["sequences_per_step"] * values["anchors_per_sequence"] * values["block_size"]


def point(positions: int, step: int, validation: dict) -> dict:
    """One curve point from a validation record of :func:`~dspark_hf.training.trainer.evaluate`."""
    return {"positions": positions, "step": step, "greedy_tau": validation["greedy_tau"],
            "greedy_survival_1": validation["greedy_survival"][0]}


def inherited_curve(init_from: str | Path | None) -> list[dict]:
    """The curve of the drafter a warm start began from: its ``training.json``'s ``curve``, else its final validation
    alone (at the positions its budget trained); ``[]`` for a fresh drafter or a folder without ``training.json``."""
    record_path = Path(init_from) / "training.json" if init_from else None
    if record_path is None or not record_path.is_file():
        return []
    record = json.loads(record_path.read_text())
    if record.get("curve"):
        return record["curve"]
    return [point(record["steps"] * positions_per_step(record["config"]), record["steps"], record["validation"])]


def run_curve(log_path: str | Path, cfg: TrainConfig, final: tuple[int, dict] | None = None) -> list[dict]:
    """The curve of a run: the inherited one (``cfg.init_from``), then each validation of the run's ``log.jsonl``
    with positions counted on from where the inherited curve ends (steps too: they are the drafter's total), then
    ``final = (step, validation)``, the run's final validation, where the log has none at that step (a run that
    ``max_minutes`` stopped between two evaluations)."""
    inherited = inherited_curve(cfg.init_from)
    start_positions, start_step = (inherited[-1]["positions"], inherited[-1]["step"]) if inherited else (0, 0)
    per_step = positions_per_step(cfg)
    points = list(inherited)
    records = map(json.loads, Path(log_path).read_text().splitlines())
    logged = [(r["step"], r["validation"]) for r in records if "validation" in r]
    for step, validation in logged + ([final] if final else []):
        if points and start_step + step <= points[-1]["step"]:  # a warm start's step 0 repeats the inherited point,
            continue  # a final validation at an evaluation step the logged one
        points.append(point(start_positions + step * per_step, start_step + step, validation))
    return points
