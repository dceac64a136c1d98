"""What the drafter returns and keeps: its per-request context cache, a drafted block, the training outputs.

Shape symbols: ``B`` requests or sequences, ``n`` context positions, ``A`` blocks per sequence, ``γ`` block size,
``V`` target vocabulary, ``V'`` draft vocabulary, ``d`` hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_buffer import KVBuffer


class DraftContext:
    """The drafter's context K/V cache for one request: per layer ``[1, kv_heads, n, head_dim]``.

    It only ever holds positions the target has ACCEPTED (the features of a round's accepted prefix
    are appended after verification), so a rejection never leaves stale entries to crop. Each layer's
    keys/values live in a :class:`~dspark_hf.modeling.kv_buffer.KVBuffer`: an append costs O(new positions).
    """

    def __init__(self, num_layers: int):
        self.buffers = [KVBuffer() for _ in range(num_layers)]
        self.length = 0

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer ``(keys, values)``, each ``[1, kv_heads, length, head_dim]`` (``None`` while empty)."""
        return [None if b.keys is None else (b.keys, b.values) for b in self.buffers]

    def append(self, kv_per_layer: list[tuple[torch.Tensor, torch.Tensor]], n: int):
        """Append ``n`` positions: per layer ``(k, v)`` of shape ``[1, kv_heads, n, head_dim]``."""
        for buffer, (k, v) in zip(self.buffers, kv_per_layer):
            buffer.append(k, v)
        self.length += n


@dataclass
class DraftBlock:
    """One drafted block for one request (γ = ``tokens.numel()``).

    Attributes:
        tokens: ``[γ]`` target-vocabulary ids, sampled left to right from ``logits``.
        logits: ``[γ, V]`` full-vocabulary draft logits after the logits processors (``-inf`` outside
            the draft vocabulary), float32 whatever the drafter's dtype; sampling drew each token from
            ``softmax(logits[k])``, the q that speculative sampling divides by. ``None`` for
            greedy drafting without logits processors (the argmax is taken in the draft vocabulary).
        confidences: ``[γ]`` raw conditional survival probabilities c_k (eq. 7), or ``None``.
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    confidences: torch.Tensor | None

    def prefix(self, gamma: int) -> DraftBlock:
        """The block's first ``gamma`` positions (drafts are left to right: a prefix is a shorter block)."""
        return DraftBlock(tokens=self.tokens[:gamma], logits=self.logits[:gamma] if self.logits is not None else None,
                          confidences=self.confidences[:gamma] if self.confidences is not None else None)


@dataclass
class DraftOutput:
    """Training outputs: ``logits`` ``[..., γ, V']`` (U + B), ``confidence_logits`` ``[..., γ]``, ``hidden``."""

    logits: torch.Tensor
    confidence_logits: torch.Tensor | None
    hidden: torch.Tensor
