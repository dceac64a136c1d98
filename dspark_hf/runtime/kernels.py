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
run the same kernels, so a benchmark's baseline gets the same speed-up as the verifier. Which kernel a single row
(a decoding step) should take depends on the machine: :func:`choose_one_row_kernel` times the model's 1-token
forward with each of :data:`ONE_ROW_KERNELS` and keeps the fastest.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .tuning import TUNE_REPEATS, faster

PACKED_ATTR = "_dspark_packed_weight"
# how a single row (a decoding step) can run: oneDNN's prepacked kernel, stock ``F.linear`` (dot products with the
# ``[out, in]`` rows), or ``x @ W^T`` on a ``[in, out]`` copy of the weight (rows of ``W^T`` scaled and summed)
ONE_ROW_KERNELS = ("prepacked", "stock", "transposed")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN can prepack on this CPU: float32, and bfloat16 where the CPU has oneDNN's bf16 path
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): on an AVX2-only CPU its reorder raises "bf16 path needs the cpu support
    avx_ne_convert or avx512bw, avx512vl and avx512dq", so bf16 linears stay stock there."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def is_prepacked(model: nn.Module) -> bool:
    """True when :func:`prepack_linears` has patched ``model``'s linear layers."""
    return any(hasattr(m, PACKED_ATTR) for m in model.modules())


def can_prepack(model: nn.Module) -> bool:
    """Whether :func:`prepack_linears` applies: torch has oneDNN and every linear weight is on the CPU in a dtype of
    :func:`packable_dtypes` (float32; bfloat16 only on CPUs with oneDNN's bf16 path)."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    dtypes = packable_dtypes()
    return torch.backends.mkldnn.is_available() and bool(weights) and all(
        w.device.type == "cpu" and w.dtype in dtypes for w in weights)


def linear_kernels(model: nn.Module) -> str:
    """Which kernels ``model``'s linear layers run (timings depend on it): ``"stock"``, ``"onednn-prepacked"``, or
    that with the kernel of a single row where :func:`choose_one_row_kernel` chose another one, e.g.
    ``"onednn-prepacked+transposed-row"``."""
    packed = next((getattr(m, PACKED_ATTR) for m in model.modules() if hasattr(m, PACKED_ATTR)), None)
    if packed is None:
        return "stock"
    return "onednn-prepacked" + ("" if packed.one_row == "prepacked" else f"+{packed.one_row}-row")


def _weight_key(w: torch.Tensor) -> tuple:
    """What a packed copy must match: storage, in-place version, dtype and device of the weight."""
    return w.data_ptr(), w._version, w.dtype, w.device


class PackedWeight:
    """A oneDNN-prepacked copy of a ``[out, in]`` weight, used by :meth:`linear` while it is current."""

    def __init__(self, weight: torch.Tensor, batch_size_hint: int = 8):
        self.batch_size_hint = batch_size_hint
        self.one_row = "prepacked"  # the kernel of a single row, one of ONE_ROW_KERNELS (choose_one_row_kernel)
        self.transposed: torch.Tensor | None = None  # ``[in, out]`` copy of the weight while a single row uses it
        self._repack(weight)

    def _repack(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.batch_size_hint)
            if self.transposed is not None:
                self.transposed = weight.detach().t().contiguous()
        self.key = _weight_key(weight)

    def use_one_row(self, kernel: str, weight: torch.Tensor) -> None:
        """Run a single row through ``kernel`` (one of :data:`ONE_ROW_KERNELS`); ``"transposed"`` keeps a ``[in,
        out]`` copy of ``weight`` (its own memory, as much as the weight's), any other kernel frees it.

        Raises:
            ValueError: ``kernel`` is not one of :data:`ONE_ROW_KERNELS`.
        """
        if kernel not in ONE_ROW_KERNELS:
            raise ValueError(f"one-row kernel must be one of {ONE_ROW_KERNELS}, got {kernel!r}.")
        self.one_row = kernel
        if kernel != "transposed":
            self.transposed = None
        elif self.transposed is None:
            with torch.no_grad():
                self.transposed = weight.detach().t().contiguous()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` (``x`` ``[..., in]`` -> ``[..., out]``) through the packed copy.

        Falls back to ``F.linear`` when autograd is recording (weight or input requires grad) or the weight is no
        longer packable (moved off the CPU, another dtype); repacks a weight changed since packing. Under
        ``torch.compile`` it is ``F.linear`` (inductor cannot lower ``mkldnn._linear_pointwise`` on a packed copy, and
        packs weights itself when freezing), so a compiled target computes what a ``prepack=False`` one does. A
        single row (``x.numel() == in``) runs the kernel ``one_row`` names (:meth:`use_one_row`).
        """
        if torch.compiler.is_compiling():
            return F.linear(x, weight, bias)
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):  # training: keep autograd
            return F.linear(x, weight, bias)
        if self.key != _weight_key(weight):
            if weight.device.type != "cpu" or weight.dtype not in packable_dtypes() or x.dtype != weight.dtype:
                return F.linear(x, weight, bias)
            self._repack(weight)
        if self.one_row != "prepacked" and x.numel() == x.shape[-1]:
            if self.one_row == "stock":
                return F.linear(x, weight, bias)
            out = torch.matmul(x, self.transposed)
            return out if bias is None else out.add_(bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return getattr(self, PACKED_ATTR).linear(x, self.weight, self.bias)


def prepack_linears(model: nn.Module, batch_size_hint: int = 8) -> nn.Module:
    """Run every ``nn.Linear`` of ``model`` through oneDNN with a prepacked copy of its weight.

    For CPU inference of the target (and its plain ``generate`` baseline): the verification cost of
    ``B`` tokens becomes nearly flat in ``B`` (module docstring). Prepack after loading and moving
    the model; calls with autograd active on a trainable weight use the stock kernel, and a
    weight updated in place or moved since packing is repacked on its next call (never used stale).
    The packed copies are extra memory: about one more copy of the linear weights (+0.5 GB for
    SmolLM2-135M in fp32, whose tied lm_head is packed separately from the embedding), and as much again where
    :func:`choose_one_row_kernel` keeps transposed copies for single rows.

    Args:
        model: a module on the CPU in a dtype of :func:`packable_dtypes` (patched in place; idempotent).
        batch_size_hint: the row count oneDNN tunes the layout for (the block size + 1 is typical).

    Returns:
        ``model``.

    Raises:
        RuntimeError: this torch build has no oneDNN (``torch.backends.mkldnn.is_available()``).
        ValueError: a linear weight is not on the CPU or not in :func:`packable_dtypes` (the message names the fix).
    """
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("prepack_linears needs a torch build with oneDNN (x86/ARM CPU wheels have it).")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and not hasattr(m, PACKED_ATTR)]
    for m in linears:
        w = m.weight
        if w.device.type != "cpu":
            raise ValueError(f"prepack_linears is for CPU models; got a weight on {w.device}. Skip it on accelerators.")
        if w.dtype not in packable_dtypes():
            names = " and ".join(str(d).removeprefix("torch.") for d in packable_dtypes())
            raise ValueError(
                f"prepack_linears supports {names} weights on this CPU, got {w.dtype} (bfloat16 needs oneDNN's bf16 "
                "path: AVX-512 BW/VL/DQ or AVX-NE-CONVERT): convert the model first (`model.float()`), or skip "
                "prepacking (`load_target(..., prepack=False)`)."
            )
    for m in linears:
        setattr(m, PACKED_ATTR, PackedWeight(m.weight, batch_size_hint))
        m.forward = types.MethodType(_packed_forward, m)
    return model


def prepack_like(model: nn.Module, reference: nn.Module) -> nn.Module:
    """Run ``model``'s linear layers on the kernels ``reference``'s run: prepacked, with the single-row kernel
    :func:`choose_one_row_kernel` chose for ``reference``, when ``reference`` is prepacked; left as they are
    otherwise (idempotent). The drafter follows its target this way (``DSparkCandidateGenerator``, the concurrent
    engine): its Markov head's per-position product ``[1, r] x [r, V']`` and a 1-position context extension are
    single rows. Measured on a 2-core AVX2 EPYC, 1 thread, the shipped drafter (γ = 7, 115 interleaved drafts): a
    draft 13.85 ms with the target's choice (``transposed``) against 15.35 ms with single rows prepacked.

    Returns:
        ``model``.

    Raises:
        As :func:`prepack_linears`.
    """
    kernel = next((getattr(m, PACKED_ATTR).one_row for m in reference.modules() if hasattr(m, PACKED_ATTR)), None)
    if kernel is None:
        return model
    prepack_linears(model)
    for m in model.modules():
        if hasattr(m, PACKED_ATTR):
            getattr(m, PACKED_ATTR).use_one_row(kernel, m.weight)
    return model


def pack_rows(head: nn.Module, rows: torch.Tensor, weight: torch.Tensor) -> PackedWeight | None:
    """The packed kernel a drafter uses for the target lm_head ``rows`` it shares (``[V', d]`` of ``weight``
    ``[V, d]``): the head's own packed copy when it shares all rows, a new one for a subset, ``None`` when the
    target's linears are not prepacked (``DSparkDrafter.bind``, via ``modeling_dspark.EXTENSIONS``)."""
    if not is_prepacked(head):
        return None
    return getattr(head, PACKED_ATTR) if rows is weight else PackedWeight(rows)


def choose_one_row_kernel(model: nn.Module, repeats: int = TUNE_REPEATS) -> str:
    """Make a single row (a decoding step) of every prepacked linear of ``model`` run the kernel of
    :data:`ONE_ROW_KERNELS` under which the model's 1-token forward is fastest on this CPU.

    Timed as a whole forward (no cache, one token), interleaved, ``repeats`` times after a warm-up
    (:func:`~dspark_hf.runtime.tuning.faster`, stored per model size, thread count and machine; ~2-3 s on a 2-core
    CPU, once), because a kernel timed alone misleads: on a 2-core AVX2 EPYC oneDNN ran SmolLM2's lm_head alone 1.2×
    faster for one row, yet the 1-token forward was 73 ms with every single row on ``F.linear`` against 85 ms
    prepacked (1 thread, ctx 256, interleaved medians of 15); on an AVX-512 EPYC prepacked was the faster (lm_head
    7.3 against 10.2 ms), on a Xeon the stock one (a forward 54.9 against 60.8 ms). On the AVX2 EPYC ``x @ W^T`` on
    a transposed copy beat both (1 thread: 73.4 against 85.7 stock and 98.9 prepacked ms at ctx 256; 2 threads:
    69.9 against 81.6 and 76.0), at the price of that copy's memory (kept only where chosen). All are exact to
    float32 rounding. Blocks of ``B > 1`` tokens always run prepacked (flat in ``B``, module docstring).

    Args:
        model: a causal LM patched by :func:`prepack_linears` (others are left alone).
        repeats: timed forwards of each kernel.

    Returns:
        The kernel chosen (one of :data:`ONE_ROW_KERNELS`), or ``"none"`` for a model without prepacked linears.
    """
    linears = [(m.weight, getattr(m, PACKED_ATTR)) for m in model.modules() if hasattr(m, PACKED_ATTR)]
    if not linears:
        return "none"
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)

    def forward_with(kernel: str):
        def run():
            for _, packed in linears:
                packed.one_row = kernel
            model(input_ids=token, use_cache=False)
        return run

    def candidates():
        for weight, packed in linears:  # the copies "transposed" reads, freed below unless it is chosen
            packed.use_one_row("transposed", weight)
        return [forward_with(kernel) for kernel in ONE_ROW_KERNELS]

    n_params = sum(p.numel() for p in model.parameters())
    chosen = ONE_ROW_KERNELS[faster(("forward-1-row", ONE_ROW_KERNELS, n_params, model.dtype), candidates, repeats)]
    for weight, packed in linears:
        packed.use_one_row(chosen, weight)
    return chosen
