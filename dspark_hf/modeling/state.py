"""What the drafter holds besides its parameters, declared: the target it is bound to (:class:`BoundTarget`), what
the installed ``dspark_hf`` plugs into it (:class:`DrafterExtensions`), and each thread's statistics of its last
``generate`` call (``DSparkDrafter.last_stats``).

Shipped with the drafter as ``trust_remote_code`` code: torch, transformers and the standard library only.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class DrafterExtensions:
    """What the installed ``dspark_hf`` plugs into the drafter (set by ``dspark_hf/__init__.py``).

    This module and its siblings are exactly the remote code a drafter's Hub repo ships for
    ``trust_remote_code``: torch and transformers only. The rest of the package (calibration, CPU kernels,
    foreign checkpoint formats) lives in higher layers and attaches here; without them the drafter still
    loads, runs its forward and drafts (no calibration, stock kernels).

    Attributes:
        check_path: ``(name_or_path, what)`` -> None; raises at once for a missing local folder.
        load_calibration: ``(file)`` -> the calibration object of ``calibration.json`` (``.save(dir)``, ``.temperatures``).
        pack_rows: ``(lm_head, rows, weight)`` -> a packed kernel for the shared lm_head rows (``.linear(x, rows)``) or None.
        import_checkpoint: ``(name_or_path, config_dict, hub_kwargs)`` -> a drafter converted from another
            checkpoint format, or None when ``config_dict`` is this package's format.
    """

    check_path: Callable[[Any, str], None] | None = None
    load_calibration: Callable[[str], Any] | None = None
    pack_rows: Callable[[nn.Module, torch.Tensor, torch.Tensor], Any] | None = None
    import_checkpoint: Callable[[Any, dict, dict], Any] | None = None


@dataclass(frozen=True)
class BoundTarget:
    """The target a drafter is bound to (:meth:`DSparkDrafter.bind`) and what the drafter borrows from it (paper
    §2.2): referenced, never copied into the drafter's parameters or its checkpoint (not an ``nn.Module``, so the
    drafter's ``state_dict``, ``parameters()`` and ``.to()`` do not see the target).

    Attributes:
        model: the target model.
        embed: its input embedding module (token ids ``[...]`` -> ``[..., d]``).
        rows: ``[V', d]`` its lm_head rows of the draft vocabulary (all ``[V, d]`` rows when ``V' = V``).
        packed: the packed CPU kernel of ``rows`` (``EXTENSIONS.pack_rows``), or ``None`` for a plain matmul.
    """

    model: nn.Module
    embed: nn.Module
    rows: torch.Tensor
    packed: Any = None


_LAST_STATS = threading.local()  # .table per thread: drafter -> its last call's statistics in that thread (weak keys)
_LATEST_STATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> its latest call's, any thread


def thread_last_stats(drafter: nn.Module):
    """The statistics of ``drafter``'s last ``generate`` call in the calling thread; a thread that has run none
    (e.g. one that started ``generate`` in a worker thread and joined it) reads the latest call's of any thread;
    ``None`` before any call."""
    table = getattr(_LAST_STATS, "table", None)
    if table is not None and drafter in table:
        return table[drafter]
    return _LATEST_STATS.get(drafter)


def set_thread_last_stats(drafter: nn.Module, stats) -> None:
    """Record ``stats`` as ``drafter``'s last call's statistics in the calling thread (and as its latest call's);
    ``None`` forgets the calling thread's, so that thread reads the latest call's of any thread again."""
    if not hasattr(_LAST_STATS, "table"):
        _LAST_STATS.table = weakref.WeakKeyDictionary()
    if stats is None:
        _LAST_STATS.table.pop(drafter, None)
        return
    _LAST_STATS.table[drafter] = stats
    _LATEST_STATS[drafter] = stats
