"""A KV cache whose append costs O(new tokens): transformers' ``DynamicCache`` on pre-allocated storage.

transformers' ``DynamicLayer`` concatenates the whole cache with the new keys/values on every forward, so a
1-token step at context 2,048 copies 2,048 positions per layer (42 % of the step for SmolLM2-135M, issue 23),
and plain decoding slows down as the context grows. :class:`GrowingLayer` keeps each layer's keys/values in a
:class:`~dspark_hf.modeling.kv_buffer.KVBuffer` (capacity grown geometrically, ≤ ~2× the live length); a crop
(speculative rejection, prompt lookup) is a length change.

:class:`GrowingCache` is a ``DynamicCache`` whose full-attention layers are :class:`GrowingLayer` (sliding-window
and other layer types keep transformers' classes), so ``generate`` handles it as any dynamic cache: plain decoding,
prompt lookup and assisted/DSpark decoding crop it with ``cache.crop(-n)``. Pass one as ``generate(...,
cache=GrowingCache(config=model.config))``, or let :func:`use_growing_cache` make it the model's default.
"""

from __future__ import annotations

import types

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..modeling.kv_buffer import KVBuffer


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` on a :class:`KVBuffer`: ``keys``/``values`` are views ``[B, H_kv, n, D]`` of the live
    positions (re-read after each update or crop); ``update`` costs O(new tokens)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.buffer = KVBuffer()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[B, H_kv, m, D]`` keys/values; returns views of all cached positions (``DynamicLayer.update``)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.buffer.append(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.buffer.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers 5.x: a negative count; positive raises)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to drop (got {tokens_to_remove}), as "
                             "transformers' DynamicLayer.crop.")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.buffer.truncate(self.buffer.length + tokens_to_remove)
        self.keys, self.values = self.buffer.keys, self.buffer.values

    def reset(self) -> None:
        self.keys = self.values = self.buffer = None
        self.is_initialized = False

    def _adopt(self) -> None:
        """Move ``self.keys``/``self.values`` (set by a stock batch operation) into a fresh buffer."""
        if self.is_initialized and self.keys is not None:
            self.buffer = KVBuffer()
            self.keys, self.values = self.buffer.append(self.keys, self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._adopt()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._adopt()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._adopt()


class GrowingCache(DynamicCache):
    """``DynamicCache`` (same arguments) whose full-attention layers are :class:`GrowingLayer`.

    Raises:
        ValueError: ``offloading=True`` (offloading moves whole tensors; use ``DynamicCache`` for it).
    """

    def __init__(self, *args, **kwargs):
        if kwargs.get("offloading"):
            raise ValueError("GrowingCache does not offload; use transformers' DynamicCache(offloading=True).")
        super().__init__(*args, **kwargs)
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = GrowingLayer
        for i, layer in enumerate(self.layers):
            if type(layer) is DynamicLayer:
                grown = GrowingLayer()
                if layer.is_initialized:  # filled from ddp_cache_data
                    grown.update(layer.keys, layer.values)
                self.layers[i] = grown


def generation_cache(model: torch.nn.Module) -> DynamicCache:
    """The empty cache ``model.generate`` starts with: a :class:`GrowingCache` after :func:`use_growing_cache`,
    else a ``DynamicCache`` (for timing a model as ``generate`` runs it, e.g. the SPS profile)."""
    config = model.config.get_text_config(decoder=True)
    return GrowingCache(config=config) if uses_growing_cache(model) else DynamicCache(config=config)


def uses_growing_cache(model: torch.nn.Module) -> bool:
    """Whether ``model.generate`` starts with a :class:`GrowingCache` (:func:`use_growing_cache` wrapped this
    instance's ``_prepare_cache_for_generation``)."""
    return getattr(model._prepare_cache_for_generation, "__func__", None) is _prepare_growing_cache


def _prepare_growing_cache(self, generation_config, model_kwargs, *args, **kwargs):
    """The class's ``_prepare_cache_for_generation``; then, where it created a plain ``DynamicCache``, a
    :class:`GrowingCache` instead (bound to one model by :func:`use_growing_cache`)."""
    type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)  # stock
    cache = model_kwargs.get("cache")
    if type(cache) is DynamicCache and not cache.offloading and not getattr(cache, "_is_user_defined", False):
        model_kwargs["cache"] = GrowingCache(config=self.config.get_text_config(decoder=True))
        if generation_config.is_assistant:  # as stock does for the cache it creates for an assistant model
            model_kwargs["cache"].activate_past_recording()


def use_growing_cache(model: torch.nn.Module) -> torch.nn.Module:
    """Make :class:`GrowingCache` the cache ``model.generate`` creates when the call names none (idempotent).

    transformers has no public setting for a custom default cache class, so this wraps ``model``'s own
    ``_prepare_cache_for_generation`` (this instance only; the class and other models are untouched): where
    transformers would create a plain ``DynamicCache``, the wrapper substitutes a :class:`GrowingCache`.
    A cache passed by the caller, ``cache_implementation=...`` and ``use_cache=False`` keep their stock meaning.
    Exit condition: a public cache-class setting in ``generate``.

    Returns:
        ``model``.
    """
    if not uses_growing_cache(model):
        model._prepare_cache_for_generation = types.MethodType(_prepare_growing_cache, model)
    return model
