"""Keys and values in pre-allocated storage: appending costs O(new tokens), cropping is a length change.

A cache that concatenates (``torch.cat([old, new], dim=2)``, transformers' ``DynamicLayer``) copies every cached
token on every step: O(context) per layer and token, 42 % of a 1-token target step at context 2,048 on a 2-core
CPU (issue 23). :class:`KVBuffer` keeps capacity ahead of the live length instead, grown geometrically (amortised
O(1) copies per token) and shrunk when a crop leaves it more than twice the live length (memory ≤ ~2× live).

Used by the target's cache (:class:`dspark_hf.runtime.kv_cache.GrowingCache`) and the drafter's context
(:class:`~dspark_hf.modeling.outputs.DraftContext`). Inference only: appends write in place.
"""

from __future__ import annotations

import torch

GROWTH = 1.5  # capacity after a reallocation, as a multiple of the length needed
HEADROOM = 64  # extra positions on top (so short prompts do not reallocate every few tokens)


class KVBuffer:
    """One layer's keys ``[B, H, n, D_k]`` and values ``[B, H, n, D_v]`` with spare capacity along ``n``.

    Attributes:
        length: live positions ``n``.
        keys / values: views ``[B, H, n, D]`` of the storage (``None`` before the first append); a later
            append or crop changes what they cover, so read them again after one.
    """

    def __init__(self):
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.length = 0

    @property
    def capacity(self) -> int:
        """Positions the storage holds without reallocating (0 before the first append)."""
        return 0 if self._k is None else self._k.shape[2]

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k`` ``[B, H, m, D_k]`` and ``v`` ``[B, H, m, D_v]`` after the live positions; O(m) unless the
        storage grows (then one copy of the live positions, amortised O(1) per token).

        Returns:
            ``(keys, values)``: views of all ``length + m`` positions.

        Raises:
            ValueError: batch, heads, head size, dtype or device differ from the stored ones (a cache is for one
                batch of one model; start a new one).
        """
        if self._k is not None and (k.shape[:2] + k.shape[3:] != self._k.shape[:2] + self._k.shape[3:]
                                    or v.shape[3:] != self._v.shape[3:] or k.dtype != self._k.dtype
                                    or k.device != self._k.device):
            raise ValueError(f"KVBuffer.append: keys {tuple(k.shape)} ({k.dtype}, {k.device}) do not fit the cached "
                             f"{tuple(self._k.shape)} ({self._k.dtype}, {self._k.device}); use a new cache per batch.")
        need = self.length + k.shape[2]
        if need > self.capacity:
            self._reallocate(need, k, v)
        self._k[:, :, self.length : need].copy_(k)
        self._v[:, :, self.length : need].copy_(v)
        self.length = need
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (a length change; storage is released when it exceeds ~2× live)."""
        self.length = max(0, min(length, self.length))
        if self._k is not None and self.capacity > 2 * self.length + 2 * HEADROOM:
            self._reallocate(self.length, self._k, self._v)

    def _reallocate(self, need: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New storage of ``GROWTH × need + HEADROOM`` positions shaped like ``k``/``v``; the live positions move."""
        cap = int(need * GROWTH) + HEADROOM
        new_k = k.new_empty(*k.shape[:2], cap, k.shape[3])
        new_v = v.new_empty(*v.shape[:2], cap, v.shape[3])
        if self.length:
            new_k[:, :, : self.length].copy_(self._k[:, :, : self.length])
            new_v[:, :, : self.length].copy_(self._v[:, :, : self.length])
        self._k, self._v = new_k, new_v
