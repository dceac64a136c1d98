"""CPU verification kernels: ``nn.Linear`` through oneDNN with prepacked weights.

Speculative decoding pays off only when verifying ``B`` tokens costs about as much as decoding one
(paper §3.2.2: the SPS curve is flat up to a knee). On x86 CPUs torch's default fp32 ``Linear``
breaks that: for 2-3 rows it takes a path 2-3x slower than for 1 row, and 8 rows cost ~1.8x one row
(lm_head of SmolLM2, 2-core AMD EPYC, 1 thread: 10.2 / 24.2 / 36.2 / 19.8 ms for 1 / 2 / 3 / 8 rows).
oneDNN's inner-product primitive with the weight reordered once into its blocked layout (what
``torch.compile`` does on CPU with weight freezing) is flat instead: 7.3 / 9.1 / 6.5 / 8.0 ms, and
the whole target verifies 8 tokens in ~1.15x the time of one (stock: ~1.55x). Results match the
stock kernel to float32 rounding (a different summation order), so greedy decoding is unchanged.

:func:`prepack_linears` patches a model in place; plain ``generate`` and speculative decoding then
run the same kernels, so a benchmark's baseline gets the same speed-up as the verifier. A single row (a decoding
step) goes to whichever of the two kernels is faster for the weight's shape on this CPU, measured once
(:mod:`dspark_hf.runtime.tuning`).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .tuning import faster

PACKED_ATTR = "_dspark_packed_weight"
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def is_prepacked(model: nn.Module) -> bool:
    """True when :func:`prepack_linears` has patched ``model``'s linear layers."""
    return any(hasattr(m, PACKED_ATTR) for m in model.modules())


def can_prepack(model: nn.Module) -> bool:
    """Whether :func:`prepack_linears` applies: torch has oneDNN and every linear weight is a CPU float32/bfloat16."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    return torch.backends.mkldnn.is_available() and bool(weights) and all(
        w.device.type == "cpu" and w.dtype in PACKABLE_DTYPES for w in weights)


def linear_kernels(model: nn.Module) -> str:
    """``"onednn-prepacked"`` or ``"stock"``: which kernels ``model``'s linear layers run (timings depend on it)."""
    return "onednn-prepacked" if is_prepacked(model) else "stock"


def _weight_key(w: torch.Tensor) -> tuple:
    """What a packed copy must match: storage, in-place version, dtype and device of the weight."""
    return w.data_ptr(), w._version, w.dtype, w.device


class PackedWeight:
    """A oneDNN-prepacked copy of a ``[out, in]`` weight, used by :meth:`linear` while it is current."""

    def __init__(self, weight: torch.Tensor, batch_size_hint: int = 8):
        self.batch_size_hint = batch_size_hint
        self._repack(weight)

    def _repack(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.batch_size_hint)
        self.key = _weight_key(weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` (``x`` ``[..., in]`` -> ``[..., out]``) through the packed copy.

        Falls back to ``F.linear`` when autograd is recording (weight or input requires grad) or the weight is no
        longer packable (moved off the CPU, another dtype); repacks a weight changed since packing. Under
        ``torch.compile`` it is ``F.linear`` (inductor cannot lower ``mkldnn._linear_pointwise`` on a packed copy, and
        packs weights itself when freezing), so a compiled target computes what a ``prepack=False`` one does. A
        single row (``x.numel() == in``) runs ``F.linear`` where that is faster for this shape here
        (:meth:`_stock_for_one_row`).
        """
        if torch.compiler.is_compiling():
            return F.linear(x, weight, bias)
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):  # training: keep autograd
            return F.linear(x, weight, bias)
        if self.key != _weight_key(weight):
            if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or x.dtype != weight.dtype:
                return F.linear(x, weight, bias)
            self._repack(weight)
        if x.numel() == x.shape[-1] and self._stock_for_one_row(weight, bias):
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def _stock_for_one_row(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether torch's stock ``F.linear`` is the faster kernel for a single row of this weight's shape on
        this CPU (:func:`~dspark_hf.runtime.tuning.faster`, once per shape and thread count): oneDNN's fixed cost
        per call outweighs its gain for a small weight on some machines (2-core AVX2 EPYC, 1 thread: a
        576 × 576 projection 0.05 ms stock against 0.09 ms prepacked, SmolLM2's 49,152-row lm_head 10.3 against
        8.6 ms; a 1-token target forward 10-13 % faster with the small layers on the stock kernel, issue 23)."""
        row = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
        return faster(("linear-1-row", *weight.shape, weight.dtype, bias is not None), lambda: (
            lambda: torch.ops.mkldnn._linear_pointwise(row, self.packed, bias, "none", [], ""),
            lambda: F.linear(row, weight, bias))) == 1


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return getattr(self, PACKED_ATTR).linear(x, self.weight, self.bias)


def prepack_linears(model: nn.Module, batch_size_hint: int = 8) -> nn.Module:
    """Run every ``nn.Linear`` of ``model`` through oneDNN with a prepacked copy of its weight.

    For CPU inference of the target (and its plain ``generate`` baseline): the verification cost of
    ``B`` tokens becomes nearly flat in ``B`` (module docstring). Prepack after loading and moving
    the model; calls with autograd active on a trainable weight use the stock kernel, and a
    weight updated in place or moved since packing is repacked on its next call (never used stale).
    The packed copies are extra memory: about one more copy of the linear weights (+0.5 GB for
    SmolLM2-135M in fp32, whose tied lm_head is packed separately from the embedding).

    Args:
        model: a module on the CPU in float32 or bfloat16 (patched in place; idempotent).
        batch_size_hint: the row count oneDNN tunes the layout for (the block size + 1 is typical).

    Returns:
        ``model``.

    Raises:
        RuntimeError: this torch build has no oneDNN (``torch.backends.mkldnn.is_available()``).
        ValueError: a linear weight is not on the CPU or not float32/bfloat16 (the message names the fix).
    """
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("prepack_linears needs a torch build with oneDNN (x86/ARM CPU wheels have it).")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and not hasattr(m, PACKED_ATTR)]
    for m in linears:
        w = m.weight
        if w.device.type != "cpu":
            raise ValueError(f"prepack_linears is for CPU models; got a weight on {w.device}. Skip it on accelerators.")
        if w.dtype not in PACKABLE_DTYPES:
            raise ValueError(
                f"prepack_linears supports float32 and bfloat16 weights, got {w.dtype}: convert the model first "
                "(`model.float()` or `model.to(torch.bfloat16)`), or skip prepacking (`load_target(..., prepack=False)`)."
            )
    for m in linears:
        setattr(m, PACKED_ATTR, PackedWeight(m.weight, batch_size_hint))
        m.forward = types.MethodType(_packed_forward, m)
    return model


def pack_rows(head: nn.Module, rows: torch.Tensor, weight: torch.Tensor) -> PackedWeight | None:
    """The packed kernel a drafter uses for the target lm_head ``rows`` it shares (``[V', d]`` of ``weight``
    ``[V, d]``): the head's own packed copy when it shares all rows, a new one for a subset, ``None`` when the
    target's linears are not prepacked (``DSparkDrafter.bind``, via ``modeling_dspark.EXTENSIONS``)."""
    if not is_prepacked(head):
        return None
    return getattr(head, PACKED_ATTR) if rows is weight else PackedWeight(rows)
