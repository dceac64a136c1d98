"""The target's hidden states at the drafter's context layers, recorded by forward hooks on those layers only.

The drafter reads the outputs of a few target decoder layers (paper §2.2, eq. 2). transformers returns them for
``output_hidden_states=[...]``, but the first such call installs a hook on every decoder layer and every attention
module of the model, and they stay for the model's lifetime: every later forward runs them, plain ``generate``
included. On a 30-layer Llama with negligible compute (1 thread, 2-core AMD EPYC, 1,490 interleaved 1-token forwards
of each, paired medians), a forward took 12.40 ms with none of those hooks, 0.41 ms more with them installed and idle,
0.49 ms more capturing four layers; :class:`LayerCapture` capturing the same four, 0.09 ms more. At SmolLM2-135M's
~65 ms a step, that is 0.75 % of every DSpark round and 0.6 % of every plain step after a first DSpark call.

The hooks live for one ``generate`` call (a ``with`` block), record only forwards run in the context that entered
it (its thread or greenlet: another request may share the model), and keep only the latest forward's outputs. They
record what ``hidden_states[i + 1]`` holds, the feature of layer ``i``
(:func:`~dspark_hf.modeling.configuration_dspark.spread_layer_ids`): layer ``i``'s output, and for the last layer the
final norm's (transformers ties its last hidden state to it).
"""

from __future__ import annotations

import contextvars

import torch

_ACTIVE = contextvars.ContextVar("layer_captures", default=())  # the LayerCaptures entered in this context


class LayerCapture:
    """Forward hooks on decoder layers ``layer_ids`` of ``model`` while entered (``with LayerCapture(...)``).

    Args:
        model: a causal LM whose decoder has a ``layers`` list (``model.get_decoder().layers``).
        layer_ids: 0-based decoder layers, in the order their features are concatenated (the drafter's
            ``config.target_layer_ids``); layer ``i`` records transformers' ``hidden_states[i + 1]``.

    Raises:
        ValueError: a layer id outside the model's decoder layers.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]):
        decoder = model.get_decoder()
        layers = decoder.layers
        if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= len(layers):
            raise ValueError(f"layer_ids {list(layer_ids)} must be decoder layers of this model (0..{len(layers) - 1}).")
        self.model, self.layer_ids = model, list(layer_ids)
        last = getattr(decoder, "norm", layers[-1])  # hidden_states[-1] is the final norm's output
        self._layers = [last if i == len(layers) - 1 else layers[i] for i in self.layer_ids]
        self._outputs: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        self._handles, self._token = [], None

    def __enter__(self) -> LayerCapture:
        self._token = _ACTIVE.set((*_ACTIVE.get(), self))
        self._handles = [layer.register_forward_hook(self._hook(j)) for j, layer in enumerate(self._layers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        _ACTIVE.reset(self._token)
        self._handles, self._outputs = [], [None] * len(self.layer_ids)

    def _hook(self, j: int):
        def record(module, args, output):
            if self in _ACTIVE.get():
                self._outputs[j] = output[0] if isinstance(output, tuple) else output
        return record

    def features(self, positions: int | None = None) -> torch.Tensor:
        """The latest forward's outputs of the layers, concatenated: ``[B, n, m·d]`` (``m`` layers of width
        ``d``; ``n`` the forward's tokens, or its first ``positions``).

        Raises:
            RuntimeError: no forward of the model ran in this context since the capture was entered.
        """
        if any(o is None for o in self._outputs):
            raise RuntimeError("LayerCapture has recorded no forward: run the target inside the `with` block, in "
                               "the thread that entered it.")
        return torch.cat([o[:, :positions] for o in self._outputs], dim=-1)

    @staticmethod
    def current(model: torch.nn.Module) -> LayerCapture:
        """The innermost capture of ``model`` entered in this context.

        Raises:
            RuntimeError: none is (the caller runs outside a DSpark ``generate`` call).
        """
        for capture in reversed(_ACTIVE.get()):
            if capture.model is model:
                return capture
        raise RuntimeError("No LayerCapture of this target is active: DSpark's candidate generator runs inside "
                           "`target.generate(..., assistant_model=drafter)`, which records the target's features.")
