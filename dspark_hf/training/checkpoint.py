"""Resumable training checkpoints, saved atomically (issue #27): a crash at any point leaves one complete
checkpoint to resume from, never none."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

MAX_SHARD_SIZE = "16MB"  # safetensors shards of saved drafters (save_pretrained's max_shard_size): each file < 16 MiB


def save_checkpoint(drafter, optimizer, generator, step: int, elapsed: float, ckpt: Path) -> None:
    """Write the resumable state to ``ckpt`` atomically: the old checkpoint is never removed before the new one
    is complete.

    The new one is written to ``<ckpt>.partial`` (drafter shards, then ``state.pt`` last), the old one moved aside
    to ``<ckpt>.old``, the new one renamed into place, and only then the old one deleted. A crash at any point
    leaves a complete checkpoint at ``ckpt`` or at ``<ckpt>.old``, which :func:`recover_checkpoint` finds.

    Args:
        drafter: saved with ``save_pretrained`` (shards of at most :data:`MAX_SHARD_SIZE`).
        optimizer, generator: their states go to ``state.pt`` with ``step`` and ``elapsed`` (seconds).
        ckpt: the checkpoint folder (``out_dir/checkpoint``).
    """
    partial, old = ckpt.with_name(ckpt.name + ".partial"), ckpt.with_name(ckpt.name + ".old")
    shutil.rmtree(partial, ignore_errors=True)  # a save that crashed earlier
    drafter.save_pretrained(partial, max_shard_size=MAX_SHARD_SIZE)
    torch.save({"optimizer": optimizer.state_dict(), "generator": generator.get_state(), "step": step,
                "elapsed": elapsed}, partial / "state.pt")  # last: its presence marks a complete checkpoint
    if (ckpt / "state.pt").is_file():
        shutil.rmtree(old, ignore_errors=True)
        ckpt.rename(old)
    elif ckpt.exists():
        shutil.rmtree(ckpt)  # an incomplete folder, never a checkpoint
    partial.rename(ckpt)
    shutil.rmtree(old, ignore_errors=True)


def recover_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint of ``out`` to resume from (``out/checkpoint``), or ``None`` for none.

    A crash between the two renames of :func:`save_checkpoint` leaves the previous checkpoint at
    ``checkpoint.old`` and no ``checkpoint``: it is moved back. A ``checkpoint.partial`` is never resumed from.
    """
    ckpt, old = out / "checkpoint", out / "checkpoint.old"
    if not (ckpt / "state.pt").is_file() and (old / "state.pt").is_file():
        shutil.rmtree(ckpt, ignore_errors=True)
        old.rename(ckpt)
    return ckpt if (ckpt / "state.pt").is_file() else None
