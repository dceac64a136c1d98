"""`DSparkConfig`: the drafter's architecture and the target it is bound to (paper §2.2, §3.1, §3.2.1)."""

from __future__ import annotations

import math
import numbers

from transformers import PreTrainedConfig

from .heads import head_names
from .limits import MAX_BLOCK_SIZE, VERIFICATION_MODES

DSPARK_VERSIONS = (1, 2)  # 1: no QK-norm, learned mask embedding; 2: the reference DSpark architecture
POSITIVE_INT_FIELDS = (  # DSparkConfig fields that are sizes or counts
    "vocab_size", "hidden_size", "target_num_layers", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings", "block_size",
    "sequential_rank",
)
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
LAYER_FIELDS = (  # the decoder layers' shapes, named as in transformers' Llama/Qwen3 configs (+ rope_theta, see layer_config)
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "max_position_embeddings",
)


def is_int(value) -> bool:
    """A true integer (``bool`` excluded: ``True`` is not a size)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def spread_layer_ids(num_target_layers: int, num_context_layers: int) -> list[int]:
    """``m`` target layer indices spread evenly from layer 1 to layer L-3 (the DFlash recipe).

    Indices are 0-based decoder layers; the feature of layer ``i`` is ``hidden_states[i + 1]``. Targets
    too shallow for ``m`` distinct layers get fewer.
    """
    first = min(1, num_target_layers - 1)
    last = max(first, num_target_layers - 3)
    if num_context_layers == 1:
        return [last]
    step = (last - first) / (num_context_layers - 1)
    return sorted({round(first + j * step) for j in range(num_context_layers)})


class DSparkConfig(PreTrainedConfig):
    """Configuration of a :class:`~dspark_hf.DSparkDrafter`.

    Args:
        target_name_or_path: id of the target the drafter was trained for (a mismatch warns at bind).
        vocab_size: the TARGET's vocabulary size (shared embedding and lm_head).
        hidden_size: the TARGET's hidden size ``d``; the drafter works in the same width.
        target_num_layers: depth ``L`` of the target.
        target_layer_ids: 0-based target layers whose outputs form the context (paper eq. 2).
        num_hidden_layers: drafter decoder layers (1-5).
        num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rms_norm_eps,
        rope_theta, max_position_embeddings: llama-style layer shapes.
        block_size: γ, draft tokens per round (1..16). Input is the anchor + γ-1 mask embeddings.
        sequential_head: ``"none"`` (parallel, DFlash-style), ``"markov"`` (eq. 5), ``"rnn"`` (eq. 6) or another
            head registered with :func:`~dspark_hf.modeling.heads.register_head`.
        sequential_rank: rank ``r`` of ``W1`` / ``W2``.
        confidence_head: whether to predict c_k (eq. 7).
        draft_vocab_size: size of the drafter's output vocabulary (most frequent target tokens;
            ``None`` = the full target vocabulary). The ids themselves are a checkpoint buffer.
        verification: default verification mode in ``generate``: ``"scheduler"`` (Algorithm 1),
            ``"async"`` (the §5.2 global search on the previous block's confidences), ``"fixed"`` or ``"threshold"``.
        confidence_threshold: default threshold of the ``"threshold"`` mode.
        dspark_version: architecture version. ``2`` (the default, the reference DSpark of DeepSpec,
            speculators and SpecForge): QK-norm, mask slots fed by the target's embedding of
            ``mask_token_id``, biases on the confidence head and the RNN head's projection. ``1``: the
            first dspark-hf drafters (no QK-norm, a learned ``mask_embedding``, no biases). A saved
            ``config.json`` without the field is a v1 checkpoint.
        qk_norm: per-head RMSNorm of queries and keys (block and context keys) before RoPE (Qwen3
            style ``q_norm``/``k_norm``). Required ``True`` in v2, ``False`` in v1.
        mask_token_id: v2 only (required there to build a drafter): target token whose frozen input embedding fills the
            γ-1 mask slots; it should be a reserved token the drafter never drafts (outside the draft
            vocabulary). ``None`` in v1 (a learned ``mask_embedding`` fills them).
        full_token_table: ``W1`` has one row per TARGET token (``[V, r]``, as the reference heads'
            ``markov_w1``) instead of ``V' + 1`` rows (draft vocabulary + one shared row for the rest).
            Set by :func:`dspark_hf.hub.export.import_drafter` for reference checkpoints whose ``W1``
            differs across tokens outside the draft vocabulary.

    Raises:
        ValueError: a field outside its domain, naming it: sizes and counts must be positive integers
            (``head_dim`` even for RoPE), ``num_attention_heads`` must divide ``hidden_size`` and
            ``num_key_value_heads`` must divide ``num_attention_heads``, ``draft_vocab_size`` lie in
            ``1..vocab_size``, γ in ``1..16``, ``confidence_threshold`` in ``[0, 1]``,
            ``target_layer_ids`` be a non-empty list of distinct layers of the target, the sequential
            head / verification mode known names; an unknown ``dspark_version``, or version-inconsistent
            ``qk_norm``/``mask_token_id`` (the message names the fix). A v2 config may leave
            ``mask_token_id`` unset (``DSparkConfig()`` builds with the defaults, as transformers needs);
            building a drafter from it raises (:meth:`check_mask_token`).
    """

    model_type = "dspark"

    def __init__(
        self,
        target_name_or_path: str = "",
        vocab_size: int = 49152,
        hidden_size: int = 576,
        target_num_layers: int = 30,
        target_layer_ids: list[int] | None = None,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int = 64,
        intermediate_size: int = 1536,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 100000.0,
        max_position_embeddings: int = 8192,
        block_size: int = 7,
        sequential_head: str = "markov",
        sequential_rank: int = 128,
        confidence_head: bool = True,
        draft_vocab_size: int | None = None,
        verification: str = "scheduler",
        confidence_threshold: float = 0.4,
        initializer_range: float = 0.02,
        dspark_version: int = 2,
        qk_norm: bool | None = None,
        mask_token_id: int | None = None,
        full_token_table: bool = False,
        **kwargs,
    ):
        self.target_name_or_path = target_name_or_path
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.target_num_layers = target_num_layers
        if target_layer_ids is None:  # only None means "default": an empty list is an error (see _check)
            target_layer_ids = spread_layer_ids(target_num_layers, 4) if is_int(target_num_layers) else []
        self.target_layer_ids = list(target_layer_ids)
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.block_size = block_size
        self.sequential_head = sequential_head
        self.sequential_rank = sequential_rank
        self.confidence_head = confidence_head
        self.draft_vocab_size = draft_vocab_size
        self.verification = verification
        self.confidence_threshold = confidence_threshold
        self.initializer_range = initializer_range
        self.dspark_version = dspark_version
        self.qk_norm = dspark_version >= 2 if qk_norm is None else qk_norm  # None: the version's value
        self.mask_token_id = mask_token_id
        self.full_token_table = full_token_table
        super().__init__(**kwargs)
        self._check()

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """As transformers', but a saved config without ``dspark_version`` is a v1 drafter."""
        return super().from_dict({"dspark_version": 1, **config_dict}, **kwargs)

    def _check(self):
        """Validate every field where it enters (``__init__``, ``from_pretrained``), naming the field."""
        self._check_fields()
        if self.dspark_version not in DSPARK_VERSIONS:
            raise ValueError(f"dspark_version must be one of {DSPARK_VERSIONS}, got {self.dspark_version!r}")
        if self.dspark_version >= 2:
            if not self.qk_norm:
                raise ValueError("dspark_version 2 drafters use QK-norm: drop qk_norm=False (or use dspark_version=1)")
            if self.mask_token_id is not None and (
                    not is_int(self.mask_token_id) or not 0 <= self.mask_token_id < self.vocab_size):
                raise ValueError(f"mask_token_id {self.mask_token_id} must lie in 0..{self.vocab_size - 1} (a target token id)")
        elif self.qk_norm or self.mask_token_id is not None:
            raise ValueError(
                "qk_norm and mask_token_id are v2 features: set dspark_version=2 (v1 drafters have neither)"
            )
        if self.sequential_head not in head_names():
            raise ValueError(f"sequential_head must be one of {head_names()}, got {self.sequential_head!r}")
        if self.verification not in VERIFICATION_MODES:
            raise ValueError(f"verification must be one of {VERIFICATION_MODES}, got {self.verification!r}")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size (γ) must be in 1..{MAX_BLOCK_SIZE}, got {self.block_size}")
        ids = self.target_layer_ids
        if not ids or any(not is_int(i) for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids must be a non-empty list of distinct layer indices, got {ids!r} "
                             "(pass None for the default spread)")
        if any(not 0 <= i < self.target_num_layers for i in ids):
            raise ValueError(
                f"target_layer_ids {ids} must lie in 0..{self.target_num_layers - 1} "
                "(the target's decoder layers)"
            )

    def check_mask_token(self):
        """Raise unless a v2 config names its ``mask_token_id``: a drafter cannot be built without it.

        A v2 config without one is valid as a config (transformers builds ``DSparkConfig()`` with the defaults,
        e.g. to diff a config against them), so the check runs where a drafter is built (``DSparkDrafter``,
        :meth:`for_target`).

        Raises:
            ValueError: naming the fix.
        """
        if self.dspark_version >= 2 and self.mask_token_id is None:
            raise ValueError(
                "dspark_version 2 needs mask_token_id: a reserved target token outside the draft vocabulary "
                "whose embedding fills the mask slots (e.g. DSparkConfig.for_target(target, mask_token_id=16) "
                "for SmolLM2's <empty_output>; dspark_hf.training.trainer.reserved_mask_token picks one from a tokenizer)"
            )

    def _check_fields(self):
        """Sizes, counts, numbers and flags: each in its domain, or a ValueError naming the field."""
        for name in POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings rotate pairs of dimensions), got {self.head_dim}")
        if self.hidden_size % self.num_attention_heads:  # transformers' LlamaConfig (MLP, RoPE) requires it
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                             f"({self.num_attention_heads}) for grouped-query attention")
        if self.draft_vocab_size is not None and (
                not is_int(self.draft_vocab_size) or not 1 <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"draft_vocab_size must be None (the full vocabulary) or an integer in 1..vocab_size "
                             f"({self.vocab_size}), got {self.draft_vocab_size!r}")
        for name in POSITIVE_FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_real(value) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not _is_real(self.initializer_range) or self.initializer_range < 0:
            raise ValueError(f"initializer_range must be a number >= 0, got {self.initializer_range!r}")
        if not _is_real(self.confidence_threshold) or not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be a probability in [0, 1], got {self.confidence_threshold!r}")
        if not isinstance(self.confidence_head, bool):
            raise ValueError(f"confidence_head must be True or False, got {self.confidence_head!r}")

    def layer_config(self) -> dict:
        """The drafter's decoder-layer shapes in transformers' config vocabulary (:data:`LAYER_FIELDS` and
        ``rope_parameters``): what the backbone builds its ``LlamaConfig`` from and what the exported checkpoints'
        layer configs hold. :meth:`layer_shapes` reads it back."""
        return {**{name: getattr(self, name) for name in LAYER_FIELDS},
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}}

    @staticmethod
    def layer_shapes(layer: dict) -> dict:
        """``DSparkConfig`` keyword arguments from a transformers decoder-layer config dict (the inverse of
        :meth:`layer_config`; an exported or foreign checkpoint's): ``head_dim`` defaults to ``hidden_size /
        num_attention_heads`` and ``rope_theta`` is read from ``rope_parameters``, else the legacy top-level field,
        else 10000 (transformers' default).

        Raises:
            KeyError: a field of :data:`LAYER_FIELDS` other than ``head_dim`` is missing.
        """
        shapes = {name: layer[name] for name in LAYER_FIELDS if name != "head_dim"}
        rope = layer.get("rope_parameters") or {}
        return {**shapes, "head_dim": layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
                "rope_theta": rope.get("rope_theta", layer.get("rope_theta", 10000.0))}

    @property
    def context_width(self) -> int:
        """``m * d``: width of the concatenated target features (input of ``W_c``)."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def uses_token_table(self) -> bool:
        """Whether the drafter has ``W1`` (needed by the sequential and the confidence heads)."""
        return self.sequential_head != "none" or self.confidence_head

    @classmethod
    def for_target(cls, target, num_context_layers: int = 4, **kwargs) -> "DSparkConfig":
        """A v2 config whose shapes follow ``target`` (a HF causal LM); ``kwargs`` override defaults.

        ``mask_token_id`` must be given for v2 (see the class docstring); ``dspark_version=1`` makes a
        v1 config.

        Raises:
            ValueError: as :class:`DSparkConfig`, e.g. no ``mask_token_id`` for a v2 config.
        """
        tc = target.config.get_text_config()
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {}
        defaults = dict(
            target_name_or_path=tc._name_or_path,
            vocab_size=target.get_output_embeddings().weight.shape[0],
            hidden_size=tc.hidden_size,
            target_num_layers=tc.num_hidden_layers,
            target_layer_ids=spread_layer_ids(tc.num_hidden_layers, num_context_layers),
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
            head_dim=head_dim,
            intermediate_size=tc.intermediate_size,
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)),
            max_position_embeddings=tc.max_position_embeddings,
        )
        config = cls(**{**defaults, **kwargs})
        config.check_mask_token()
        return config
