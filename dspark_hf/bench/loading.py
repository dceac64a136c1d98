"""Loading what ``dspark bench`` compares: the drafters named by ``--drafters``."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..defaults import resolve_checkout_path


def _log_default(*args):
    print(*args, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class DrafterSource:
    """Where a benched drafter came from, as ``benchmarks.json`` records it (``drafters[name]``).

    Attributes:
        path: the folder it was loaded from (``None``: built in memory, e.g. by a test).
        calibration: ``"calibration.json"``, or the note that the identity STS stands in for a missing one.
    """

    path: str | None = None
    calibration: str = "calibration.json"


def parse_drafters(spec: str) -> dict[str, str]:
    """``"a=PATH,b=PATH"`` -> ``{"a": "PATH", "b": "PATH"}``.

    Raises:
        ValueError: an entry without ``=`` or a repeated name.
    """
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--drafters entries are name=PATH, got {item!r}")
        if name in out:
            raise ValueError(f"drafter name {name!r} given twice")
        out[name] = path
    return out


def load_drafters(spec: dict[str, str], target, gamma: int, log=_log_default) -> tuple[dict, dict, list[str]]:
    """Load every drafter folder that exists (relative paths: CWD first, then the repo root), bind it.

    A drafter with a confidence head but no ``calibration.json`` gets identity STS (all T = 1), and a note.

    Returns:
        ``({name: drafter}, {name: DrafterSource}, notes)``.

    Raises:
        ValueError: a calibration that covers fewer than γ positions.
    """
    from ..decoding.calibration import SequentialTemperatureScaling
    from ..modeling.modeling_dspark import DSparkDrafter

    drafters, sources, notes = {}, {}, []
    for name, path in spec.items():
        folder = resolve_checkout_path(path)
        if not folder.is_dir():
            note = f"drafter {name!r}: no folder at {path}; skipped." + (
                " The ablation drafters ship in a clone of the repository, not in the wheel."
                if Path(path).parts[:1] == ("ablations",) else "")
            log(f"note: {note}")
            notes.append(note)
            continue
        drafter = DSparkDrafter.from_pretrained(str(folder)).bind(target).eval()
        sources[name] = DrafterSource(path=str(folder))
        if drafter.confidence is not None and drafter.calibration is None:
            drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * max(gamma, drafter.config.block_size))
            sources[name] = DrafterSource(path=str(folder), calibration="identity (no calibration.json)")
            note = (f"drafter {name!r} has no calibration.json: STS is the identity (all T = 1), so 'after STS' "
                    "equals 'before' and the scheduler uses raw confidences.")
            log(f"note: {note}")
            notes.append(note)
        if drafter.calibration is not None and len(drafter.calibration.temperatures) < gamma:
            raise ValueError(f"drafter {name!r}: calibration covers {len(drafter.calibration.temperatures)} positions, "
                             f"γ = {gamma}; pass --gamma {len(drafter.calibration.temperatures)} or recalibrate.")
        if drafter.config.block_size != gamma:
            notes.append(f"drafter {name!r} was trained with block_size {drafter.config.block_size}; benched at γ = {gamma}.")
        drafters[name] = drafter
    return drafters, sources, notes
