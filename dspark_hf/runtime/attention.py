"""Grouped-query attention without copies under any mask: SDPA with ``enable_gqa=True``.

transformers' ``sdpa`` attention expands the grouped K/V heads into full copies (``repeat_kv``) whenever a mask
is passed on the CPU, and a verification block of ``B > 1`` tokens always has one. At context 2,048 that copy
was 47 % of the target's forward for ``B = 8`` (SmolLM2-135M, 1 thread; issue 23), so verifying 8 tokens cost
2.35× one token instead of ~1.1×. :func:`sdpa_gqa_attention_forward` hands the grouped heads to
``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` instead, whose CPU kernels read each
K/V head for its whole group of query heads.

It is registered as :data:`SDPA_GQA` through transformers' public ``AttentionInterface``, with
``AttentionMaskInterface`` building the mask exactly as for ``"sdpa"``; :func:`use_gqa_attention` switches a
model to it (``load_target`` does on the CPU unless ``stock_kernels=True``). Same maths as ``sdpa``: logits
agree to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

SDPA_GQA = "dspark_sdpa_gqa"  # the attn_implementation name registered by register_gqa_attention


def sdpa_gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, is_causal: bool | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: SDPA over grouped K/V heads without expanding them.

    Args:
        module: the attention module (its ``is_causal`` is read when ``is_causal`` is None).
        query: ``[B, H, q, D]``; key / value: ``[B, H_kv, k, D]`` with ``H`` a multiple of ``H_kv``.
        attention_mask: ``[B, 1, q, k]`` boolean or additive mask built by ``sdpa_mask``, or ``None``.
        dropout / scaling / is_causal: as for ``sdpa``.
        **kwargs: what transformers passes; a ``position_bias``, ``softcap`` or ``output_attentions`` request goes
            to the stock ``sdpa`` function (which handles or rejects them).

    Returns:
        ``(attn_output [B, q, H, D], None)``.
    """
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_length > 1 and attention_mask is None and causal  # as sdpa: a mask, when given, holds causality
    if causal and key.shape[2] > q_length:  # prefill into pre-sized storage: the keys past the query are padding
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    batch, heads, _, head_dim = query.shape
    groups = heads // key.shape[1]
    if groups > 1 and not causal and (attention_mask is None or attention_mask.shape[1] == 1):
        query, attention_mask = _pack_groups(query, attention_mask, groups)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.reshape(batch, heads, q_length, value.shape[-1]).transpose(1, 2).contiguous(), None


def _pack_groups(query: torch.Tensor, mask: torch.Tensor | None, groups: int):
    """Fold each K/V head's group of query heads into rows: query ``[B, H, q, D]`` -> ``[B, H_kv, groups·q, D]``
    and a head-shared mask ``[B, 1, q, k]`` -> ``[B, 1, groups·q, k]`` (row ``j·q + i``: head ``j`` of the group,
    query ``i``). Every K/V head is then read once for all its queries (15-20 % faster than ``enable_gqa`` for
    a few queries over a long cache on a CPU)."""
    batch, heads, q_length, head_dim = query.shape
    packed = query.reshape(batch, heads // groups, groups * q_length, head_dim)
    if mask is not None:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * q_length, -1)
    return packed, mask


def register_gqa_attention() -> str:
    """Register :data:`SDPA_GQA` with transformers' attention and mask registries (idempotent); returns the name."""
    AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention_forward)
    AttentionMaskInterface.register(SDPA_GQA, sdpa_mask)
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
