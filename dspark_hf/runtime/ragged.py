"""One target forward for many requests: a ragged batch with per-request KV caches and no padding.

Paper §3.2.2 counts a verification step by its total tokens ``B = Σ_r (1 + ℓ_r)``: R requests, each with its own
context length and its own number of verified drafts. A padded ``[R, max(1 + ℓ_r)]`` batch would pay for
``R · max(1 + ℓ_r)`` tokens and a ``[R, max context]`` cache; this module runs the target on ONE row of ``B``
tokens instead (the requests' segments side by side), with

* explicit ``position_ids`` (each segment continues its own request's positions),
* a block-diagonal causal attention: segment ``r`` attends to request ``r``'s cache and causally to itself, and
  to nothing of the other requests (:func:`ragged_attention_forward`, registered through transformers' public
  ``AttentionInterface`` as :data:`RAGGED`),
* one :class:`RequestKV` per request (a :class:`~dspark_hf.modeling.kv_buffer.KVBuffer` per layer): the forward
  appends each segment's keys/values to its request, and a rejection is rolled back with
  :meth:`RequestKV.truncate`,
* ``logits_to_keep`` as the list of rows whose logits are needed (all of a verification segment, the last of a
  prefill segment).

The attention function reads the batch layout from a ``ragged=`` keyword that transformers passes through the
model's forward to every attention call; without it, it is
:func:`~dspark_hf.runtime.attention.sdpa_gqa_attention_forward`, so a target switched to :data:`RAGGED`
(:func:`ragged_attention`) computes what it computed before for any other call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from ..modeling.kv_buffer import KVBuffer
from .attention import SDPA_GQA, sdpa_gqa_attention_forward

RAGGED = "dspark_ragged"  # the attn_implementation name registered by register_ragged_attention


class RequestKV:
    """One request's target KV cache: per layer a :class:`KVBuffer` of keys/values ``[1, H_kv, n, D]``.

    Attributes:
        length: positions every layer holds (``n``), i.e. the request's tokens already seen by the target.
    """

    def __init__(self, num_layers: int):
        self.buffers = [KVBuffer() for _ in range(num_layers)]
        self.length = 0

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer (a rejection's rollback: a length change)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"RequestKV.truncate: {length} is outside 0..{self.length}.")
        for buffer in self.buffers:
            buffer.truncate(length)
        self.length = length


@dataclass
class RaggedBatch:
    """The layout of one ragged forward: segment ``r`` brings ``new_tokens[r]`` tokens of request ``caches[r]``.

    Attributes:
        caches: one :class:`RequestKV` per segment (distinct requests).
        new_tokens: ``m_r >= 1`` tokens per segment, in the order of the forward's row.
    """

    caches: Sequence[RequestKV]
    new_tokens: Sequence[int]

    def __post_init__(self):
        if len(self.caches) != len(self.new_tokens) or not self.caches:
            raise ValueError("RaggedBatch needs one cache per segment and at least one segment.")
        if min(self.new_tokens) < 1:
            raise ValueError(f"every segment needs at least one token, got {list(self.new_tokens)}.")

    @property
    def total_tokens(self) -> int:
        """``B = Σ_r m_r``."""
        return sum(self.new_tokens)

    def position_ids(self, device=None) -> torch.Tensor:
        """``[1, B]``: segment ``r`` holds positions ``n_r .. n_r + m_r - 1`` of its own request."""
        return torch.cat([torch.arange(c.length, c.length + m, device=device)
                          for c, m in zip(self.caches, self.new_tokens)])[None]


def ragged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, ragged: RaggedBatch | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: block-diagonal causal attention over a :class:`RaggedBatch`.

    Args:
        module: the attention module; its ``layer_idx`` selects the layer of each request's cache.
        query: ``[1, H, B, D]``; key / value: ``[1, H_kv, B, D]``, the NEW tokens' states (the forward runs
            without a transformers cache: each segment's keys/values are appended to its own request here).
        attention_mask: ignored with ``ragged`` (the layout defines the mask); passed on without it.
        ragged: the batch layout; ``None`` makes this :func:`sdpa_gqa_attention_forward` (any other call).

    Returns:
        ``(attn_output [1, B, H, D], None)``.

    Raises:
        ValueError: the queries do not cover ``ragged.total_tokens`` positions.
    """
    if ragged is None:
        return sdpa_gqa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != ragged.total_tokens:
        raise ValueError(f"ragged attention expects queries [1, H, {ragged.total_tokens}, D], got "
                         f"{tuple(query.shape)}.")
    outputs, start = [], 0
    for cache, m in zip(ragged.caches, ragged.new_tokens):
        buffer = cache.buffers[module.layer_idx]
        n = buffer.length
        keys, values = buffer.append(key[:, :, start:start + m], value[:, :, start:start + m])  # [1, H_kv, n+m, D]
        mask = None
        if m > 1 and n > 0:  # row i sees the n cached positions and its own segment up to itself
            mask = (torch.arange(n + m, device=query.device)[None] <= n + torch.arange(m, device=query.device)[:, None])
            mask = mask[None, None]  # [1, 1, m, n+m]
        out, _ = sdpa_gqa_attention_forward(module, query[:, :, start:start + m], keys, values, mask,
                                            dropout=dropout, scaling=scaling, is_causal=n == 0)
        outputs.append(out)  # [1, m, H, D]
        start += m
    return torch.cat(outputs, dim=1), None


def register_ragged_attention() -> str:
    """Register :data:`RAGGED` with transformers' attention and mask registries (idempotent); returns the name."""
    AttentionInterface.register(RAGGED, ragged_attention_forward)
    AttentionMaskInterface.register(RAGGED, sdpa_mask)
    return RAGGED


@contextlib.contextmanager
def ragged_attention(target: torch.nn.Module):
    """Run ``target`` with :data:`RAGGED` attention inside the block; its own implementation comes back after.

    Raises:
        ValueError: the target uses an attention other than ``sdpa``, ``eager`` or :data:`~dspark_hf.decoding.
            attention.SDPA_GQA` (flash / flex kernels keep their own cache layouts and are not wrapped here).
    """
    before = getattr(target.config, "_attn_implementation", None)
    if before not in ("sdpa", "eager", SDPA_GQA, RAGGED):
        raise ValueError(f"Batched DSpark decoding runs the target's attention as {RAGGED!r} and supports targets "
                         f"using 'sdpa' or 'eager' attention; this one uses {before!r}.")
    if before != RAGGED:
        target.set_attn_implementation(register_ragged_attention())
    try:
        yield target
    finally:
        if before != RAGGED:
            target.set_attn_implementation(before)


def ragged_forward(target: torch.nn.Module, input_ids: torch.Tensor, batch: RaggedBatch,
                   keep: torch.Tensor) -> torch.Tensor:
    """One target forward over a :class:`RaggedBatch` (inside :func:`ragged_attention`); a
    :class:`~dspark_hf.runtime.capture.LayerCapture` entered around it records the layers a drafter reads.

    Args:
        input_ids: ``[1, B]`` the segments' tokens side by side.
        batch: the layout; each request's cache grows by its segment (``length += m_r``).
        keep: ``[K]`` row indices whose logits are returned (``logits_to_keep``).

    Returns:
        ``[K, V]`` float32 logits.
    """
    out = target(input_ids=input_ids, position_ids=batch.position_ids(input_ids.device), use_cache=False,
                 logits_to_keep=keep, ragged=batch)
    for cache, m in zip(batch.caches, batch.new_tokens):
        cache.length += m
    return out.logits[0].float()
