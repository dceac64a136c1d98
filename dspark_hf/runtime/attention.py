"""Grouped-query attention without copies under any mask: SDPA over folded query heads, or ``enable_gqa=True``.

transformers' ``sdpa`` attention expands the grouped K/V heads into full copies (``repeat_kv``) whenever a mask
is passed on the CPU, and a verification block of ``B > 1`` tokens always has one. At context 2,048 that copy
was 47 % of the target's forward for ``B = 8`` (SmolLM2-135M, 1 thread; issue 23), so verifying 8 tokens cost
2.35× one token instead of ~1.1×. :func:`sdpa_gqa_attention_forward` never copies K/V: for a block of up to
:data:`FOLD_MAX_QUERIES` queries it folds the ``g`` query heads of each K/V head into the query axis (``[B, H, q,
D]`` -> ``[B, H_kv, g·q, D]``), so ``torch.nn.functional.scaled_dot_product_attention`` reads each K/V head once
for one score product of ``g·q`` rows, where that is the faster kernel on this CPU (measured once per shape and
thread count, :func:`folds`); otherwise, and for longer blocks (prefill), SDPA's ``enable_gqa=True``.

It is registered as :data:`SDPA_GQA` through transformers' public ``AttentionInterface``, with
``AttentionMaskInterface`` building the mask as for ``"sdpa"`` and, for a short block, folding it once per forward
(:func:`gqa_sdpa_mask`); :func:`use_gqa_attention` switches a model to it (``load_target`` does on the CPU unless
``stock_kernels=True``). Same maths as ``sdpa``: logits agree to float32 rounding.

What a B = 8 block costs over a long cache is the attention arithmetic itself: torch's CPU flash kernel runs the
two score products at ~40 GFLOP/s on one core of the reference machine (its GEMMs reach ~90 in cache), and a
hand-composed ``matmul`` + ``softmax`` + ``matmul`` was not faster at any measured shape
(``docs/long/verify_cost.md``). Part of that is the kernel waiting on K/V read from memory, which a block's many
rows do not hide: a folded block over at least :data:`PREFETCH_MIN_KEYS` positions runs one K/V head at a time,
each head's keys and values read into the cache first (:func:`_sdpa_head_by_head`), where that is faster on this CPU
at torch's current thread count (:func:`splits_heads`, measured once per shape; on the reference EPYC it is at 1
thread, a B = 8 verification 4-9 % faster at ctx 2,048 and 5-7 % at 4,096, and not at 2, issue 23).
"""

from __future__ import annotations

from itertools import cycle

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .tuning import faster

SDPA_GQA = "dspark_sdpa_gqa"  # the attn_implementation name registered by register_gqa_attention
FOLD_MAX_QUERIES = 64  # fold the query heads of a group into rows for at most this many queries (not prefill)
TUNE_CONTEXT = 2048  # cached positions when timing folded against enable_gqa (folds)
TUNE_BLOCK = 8  # the block size timed for every block of 2..FOLD_MAX_QUERIES tokens
PREFETCH_MIN_KEYS = 1024  # a folded block over at least this many positions may run head by head (splits_heads)
TUNE_RING_BYTES = 12 * 2**20  # K/V buffers cycled through when timing head by head, so each call reads them anew


def sdpa_gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, is_causal: bool | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: SDPA over grouped K/V heads without expanding them.

    Args:
        module: the attention module (its ``is_causal`` is read when ``is_causal`` is None).
        query: ``[B, H, q, D]``; key / value: ``[B, H_kv, k, D]`` with ``H`` a multiple of ``H_kv``.
        attention_mask: ``[B, 1, q, k]`` boolean or additive mask built by ``sdpa_mask``, the same folded by
            :func:`gqa_sdpa_mask` (``[B, 1, g·q, k]``, each query's row repeated for the ``g`` heads of a group),
            a per-head ``[B, H, q, k]`` mask, or ``None``.
        dropout / scaling / is_causal: as for ``sdpa``.
        **kwargs: what transformers passes; a ``position_bias``, ``softcap`` or ``output_attentions`` request goes
            to the stock ``sdpa`` function (which handles or rejects them).

    A folded block of ``q > 1`` queries over at least :data:`PREFETCH_MIN_KEYS` positions on the CPU runs one K/V
    head at a time (:func:`_sdpa_head_by_head`) where that is faster at torch's current thread count
    (:func:`splits_heads`).

    Returns:
        ``(attn_output [B, q, H, D], None)``.
    """
    q_length = query.shape[2]
    folded = None
    rows = 0 if attention_mask is None else attention_mask.shape[-2]
    if rows > q_length and rows % q_length == 0:  # folded by gqa_sdpa_mask: its first q rows are the mask
        folded, attention_mask = attention_mask, attention_mask.unflatten(-2, (-1, q_length))[:, :, 0]
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_length > 1 and attention_mask is None and causal  # as sdpa: a mask, when given, holds causality
    if causal and key.shape[2] > q_length:  # prefill into pre-sized storage: the keys past the query are padding
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    batch, heads, _, head_dim = query.shape
    groups = heads // key.shape[1]
    head_by_head = False
    if (groups > 1 and not causal and q_length <= FOLD_MAX_QUERIES and folds(query, heads // groups)
            and (attention_mask is None or attention_mask.shape[1] == 1)):
        head_by_head = q_length > 1 and key.shape[2] >= PREFETCH_MIN_KEYS and splits_heads(query, heads // groups)
        query = query.reshape(batch, heads // groups, groups * q_length, head_dim)
        if folded is not None and folded.shape[-2] == groups * q_length:
            attention_mask = folded
        elif attention_mask is not None:
            attention_mask = fold_mask(attention_mask, groups)
    if head_by_head:
        out = _sdpa_head_by_head(query, key, value, attention_mask, dropout, scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.reshape(batch, heads, q_length, value.shape[-1]).transpose(1, 2).contiguous(), None


def _sdpa_head_by_head(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                       dropout: float, scale: float | None) -> torch.Tensor:
    """SDPA of folded queries one K/V head at a time, each head's keys and values first read into the cache.

    torch's CPU flash kernel stalls on K/V that come from memory when a block's rows make it compute-heavy: one
    layer's folded B = 8 attention (24 rows per K/V head, SmolLM2) over 4,104 positions ran at 686 ns per position
    with its 6.3 MB of K/V out of cache and 414 with them in cache (``docs/long/verify_cost.md``). In a forward a
    layer's K/V always come from memory (the weights streamed in between evict them), and a whole layer's K/V
    (3.1 MB at ctx 2,048 for SmolLM2) do not stay in the cache, one head's (a third) mostly do: so each head's keys
    and values are read by a ``sum`` just before that head's kernel (a contiguous read, which the hardware
    prefetcher streams: a B = 8 forward 0.91-0.96× the one call at ctx 2,048, where a strided ``sum`` touching one
    value per 64-byte line gave 0.96-0.985×; issue 23). Same kernel, same maths per head: the output equals the one-call SDPA
    exactly. Whether this wins depends on the CPU and the thread count (:func:`splits_heads` measures it).

    Args:
        query: ``[B, H_kv, g·q, D]`` (folded); key / value: ``[B, H_kv, k, D]``.
        attn_mask: the folded mask ``[B, 1, g·q, k]`` (shared by the heads) or ``None``.
        dropout / scale: as for ``scaled_dot_product_attention``.

    Returns:
        ``[B, H_kv, g·q, D]``.
    """
    out = []
    for h in range(key.shape[1]):
        k, v = key[:, h : h + 1], value[:, h : h + 1]  # [B, 1, k, D]
        k.sum(), v.sum()  # read this head's K/V once: the kernel below finds them in cache
        out.append(F.scaled_dot_product_attention(query[:, h : h + 1], k, v, attn_mask=attn_mask, dropout_p=dropout,
                                                  scale=scale))
    return torch.cat(out, dim=1)


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """A head-shared mask ``[B, 1, q, k]`` for the query heads of a group folded into rows: ``[B, 1, groups·q, k]``,
    row ``j·q + i`` = query ``i`` (head ``j`` of the group), i.e. the mask repeated ``groups`` times.

    Folding the ``groups`` query heads of a K/V head into the query axis (query ``[B, H, q, D]`` ->
    ``[B, H_kv, groups·q, D]``) makes SDPA read each K/V head once, for one score product of ``groups·q`` rows
    (10-22 % faster than ``enable_gqa`` for 1-8 queries over a 2k-4k cache on one CPU thread)."""
    return mask[:, :, None].expand(-1, -1, groups, -1, -1).flatten(2, 3)


def gqa_sdpa_mask(*args, config=None, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """An ``AttentionMaskInterface`` function: ``sdpa_mask`` (same arguments), then, for a block of at most
    :data:`FOLD_MAX_QUERIES` queries of a grouped-query model, the mask folded for :func:`sdpa_gqa_attention_forward`
    once per forward instead of once per layer (:func:`fold_mask`) and made additive (``0`` where attended,
    ``finfo(dtype).min`` where not), so SDPA does not convert it either: 4 % of a B = 8 verification at ctx 4,096
    (SmolLM2-135M, 1 thread).

    Returns:
        ``None`` (no mask needed), the stock boolean mask ``[B, 1, q, k]``, or the folded additive mask
        ``[B, 1, g·q, k]`` in ``dtype`` (``g = num_attention_heads / num_key_value_heads`` of ``config``).
    """
    mask = sdpa_mask(*args, config=config, dtype=dtype, **kwargs)
    groups = _query_groups(config)
    if mask is None or mask.dtype != torch.bool or groups == 1 or mask.shape[-2] > FOLD_MAX_QUERIES:
        return mask
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return fold_mask(additive, groups)


def folds(query: torch.Tensor, kv_heads: int) -> bool:
    """Whether a layer folds the query heads of a group into rows for ``query``: where that is the faster kernel on
    this CPU at torch's current thread count (:func:`~dspark_hf.runtime.tuning.faster`: one layer's attention of a
    1-token step, or of a :data:`TUNE_BLOCK`-token block for any block, over :data:`TUNE_CONTEXT` cached positions,
    folded against ``enable_gqa``, ~10-25 ms once per shape). Always on other devices (one kernel reading each K/V
    head once).

    Folding SmolLM2's 9 query heads into its 3 K/V heads leaves 3 work items for torch's threads: on 2 threads one
    EPYC (AVX-512) ran a folded 1-token step 9 % slower, another (AVX2 only) 2-16 % faster, and 33 % faster for 8
    tokens (``docs/long/verify_cost.md``, issue 23).

    Args:
        query: ``[B, H, q, D]``, ``q <= FOLD_MAX_QUERIES``.
        kv_heads: K/V heads ``H_kv`` (``H`` a multiple of it).
    """
    if query.device.type != "cpu":
        return True
    batch, heads, q_length, head_dim = query.shape
    q_length = TUNE_BLOCK if q_length > 1 else 1
    return faster(("attention-fold", batch, heads, kv_heads, head_dim, query.dtype, q_length),
                  lambda: _attention_kernels(batch, heads, kv_heads, head_dim, query.dtype, q_length)) == 0


def _attention_kernels(batch: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, q_length: int):
    """One layer's attention of a ``q_length``-token block over ``TUNE_CONTEXT`` random cached positions: ``(folded,
    enable_gqa)`` callables. A block has the additive mask :func:`gqa_sdpa_mask` builds; one token none (as in
    decoding)."""
    query, key, value, mask, folded_query, folded_mask = _timed_block(batch, heads, kv_heads, head_dim, dtype, q_length)
    return (lambda: F.scaled_dot_product_attention(folded_query, key, value, attn_mask=folded_mask),
            lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True))


def splits_heads(query: torch.Tensor, kv_heads: int) -> bool:
    """Whether a folded block of ``q > 1`` queries runs one K/V head at a time (:func:`_sdpa_head_by_head`): where
    that is faster than one SDPA call on this CPU at torch's current thread count
    (:func:`~dspark_hf.runtime.tuning.faster`: one layer's folded attention of a :data:`TUNE_BLOCK`-token block over
    :data:`TUNE_CONTEXT` cached positions, each call on the next K/V of a ring of :data:`TUNE_RING_BYTES`, so that
    it reads them from memory as a forward does, ~25-35 ms once per shape). Never on other devices.

    On the reference EPYC (AVX-512) it is at 1 thread (in 9 of 10 processes; a B = 8 verification 4-9 % faster at
    ctx 2,048) and not at 2 (10 of 10), where running SmolLM2's 3 K/V heads one at a time leaves a thread idle
    (``docs/long/verify_cost.md``).

    Args:
        query: ``[B, H, q, D]`` (not folded), ``q <= FOLD_MAX_QUERIES``.
        kv_heads: K/V heads ``H_kv`` (``H`` a multiple of it).
    """
    if query.device.type != "cpu":
        return False
    batch, heads, _, head_dim = query.shape
    return faster(("attention-head-by-head", batch, heads, kv_heads, head_dim, query.dtype),
                  lambda: _head_split_kernels(batch, heads, kv_heads, head_dim, query.dtype)) == 1


def _head_split_kernels(batch: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """One layer's folded attention of a ``TUNE_BLOCK``-token block over ``TUNE_CONTEXT`` cached positions under
    :func:`gqa_sdpa_mask`'s additive mask: ``(one call, head by head)`` callables. Each call takes the next K/V of a
    ring of several layers' (``TUNE_RING_BYTES`` in all, at least 2 layers), shared by both, so neither finds them in
    cache from its previous call."""
    _, key, value, _, query, mask = _timed_block(batch, heads, kv_heads, head_dim, dtype, TUNE_BLOCK)
    layers = max(2, TUNE_RING_BYTES // (2 * key.numel() * key.element_size()))
    ring = cycle([(key, value)] + [(key.clone(), value.clone()) for _ in range(layers - 1)])

    def one_call():
        key, value = next(ring)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)

    def head_by_head():
        key, value = next(ring)
        return _sdpa_head_by_head(query, key, value, mask, 0.0, None)

    return one_call, head_by_head


def _timed_block(batch: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, q_length: int):
    """Random inputs of one layer's attention of a ``q_length``-token block over ``TUNE_CONTEXT`` cached positions:
    ``(query [B, H, q, D], key, value [B, H_kv, TUNE_CONTEXT, D], mask, folded query [B, H_kv, g·q, D], folded
    mask)``; the masks are additive zeros ``[B, 1, q, TUNE_CONTEXT]`` / ``[B, 1, g·q, TUNE_CONTEXT]`` for a block,
    ``None`` for one token (as in decoding)."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, q_length, head_dim, generator=g, dtype=dtype)
    key, value = (torch.randn(batch, kv_heads, TUNE_CONTEXT, head_dim, generator=g, dtype=dtype) for _ in range(2))
    mask = None if q_length == 1 else torch.zeros(batch, 1, q_length, TUNE_CONTEXT, dtype=dtype)
    groups = heads // kv_heads
    folded_query = query.reshape(batch, kv_heads, groups * q_length, head_dim)
    return query, key, value, mask, folded_query, None if mask is None else fold_mask(mask, groups)


def model_splits_heads(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention runs a folded block over at least :data:`PREFETCH_MIN_KEYS` positions head by
    head at torch's current thread count: it runs :func:`sdpa_gqa_attention_forward`, has grouped K/V heads,
    folds a block (:func:`folds`) and :func:`splits_heads` says so for a 1-sequence block (each measured here if it
    was not yet). What :func:`~dspark_hf.runtime.targets.kernels_label` reports as ``+head-by-head``."""
    config = model.config
    groups = _query_groups(config)
    if not uses_gqa_attention(model) or groups == 1:
        return False
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    param = next(model.parameters())
    query = torch.empty(1, heads, TUNE_BLOCK, head_dim, dtype=param.dtype, device=param.device)
    return folds(query, heads // groups) and splits_heads(query, heads // groups)


def _query_groups(config) -> int:
    """Query heads per K/V head in ``config`` (1 without a config or grouped heads)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads // kv_heads if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads == 0 else 1


def register_gqa_attention() -> str:
    """Register :data:`SDPA_GQA` with transformers' attention and mask registries (idempotent); returns the name."""
    AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention_forward)
    AttentionMaskInterface.register(SDPA_GQA, gqa_sdpa_mask)
    return SDPA_GQA


def uses_gqa_attention(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs :func:`sdpa_gqa_attention_forward`."""
    return getattr(model.config, "_attn_implementation", None) == SDPA_GQA


def use_gqa_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` from ``"sdpa"`` to :data:`SDPA_GQA` (``model.set_attn_implementation``); other
    implementations (eager, flash, flex) are left alone.

    Returns:
        Whether ``model`` now uses :data:`SDPA_GQA`.
    """
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(register_gqa_attention())
    return uses_gqa_attention(model)
