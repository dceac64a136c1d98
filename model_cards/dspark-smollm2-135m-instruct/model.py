"""`DSparkDrafter`: a DFlash-style parallel backbone with sequential and confidence heads.

Paper §2.2 (context injection, eqs. 2-3), §3.1 (semi-autoregressive drafting, eqs. 4-6) and §3.2.1
(confidence, eq. 7). The drafter shares the target's token embedding and lm_head: they are attached
by :meth:`DSparkDrafter.bind`, never copied into the drafter's parameters or its checkpoint.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers import initialization as init
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from transformers.utils.hub import cached_file

from .calibration import CALIBRATION_FILE, SequentialTemperatureScaling
from .config import DSparkConfig
from .kernels import PACKED_ATTR, PackedWeight, is_prepacked
from .heads import ConfidenceHead, MarkovHead, RNNHead


def _llama_config(config: DSparkConfig) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
    )


def _lm_head_weight(head) -> torch.Tensor:
    """The ``[V, d]`` floating-point weight of a target's lm_head, which the drafter shares (paper §2.2).

    Raises:
        TypeError: ``head`` has no such tensor (a quantized module exposes ``weight`` as a method or an
            integer tensor); the message says what is supported.
    """
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise TypeError(
            f"DSpark reads the target's lm_head rows directly, so the lm_head must be a module with a floating-point "
            f"[vocab, hidden] `weight` tensor (nn.Linear in float32/bfloat16/float16); got {type(head).__module__}."
            f"{type(head).__name__}. Use an unquantized (float32/bfloat16/float16) target."
        )
    return weight


def _check_row_independent(target):
    """Refuse targets whose token logits depend on the OTHER tokens of a forward (verification would not be lossless).

    ``torch.ao`` dynamic quantization computes one activation scale per forward over all its tokens, so the
    verification forward's logits at a position depend on the values of the drafts after it, and acceptance
    would depend on draft values (paper Appendix A). Float kernels (any batch size) are row-independent.

    Raises:
        TypeError: a dynamically quantized module is found; the message names what is supported.
    """
    dynamic = sorted({type(m).__name__ for m in target.modules() if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic")})
    if dynamic:
        raise TypeError(
            f"The target has dynamically quantized modules ({', '.join(dynamic)}: torch.ao quantize_dynamic). Their "
            "activation scale is computed over all tokens of a forward, so a verified token's logits would depend on "
            "the drafts verified with it and speculative decoding would not be lossless. Use a float32/bfloat16/float16 "
            "target, or a weight-only quantization whose tokens are computed independently."
        )


class DSparkAttention(nn.Module):
    """GQA attention whose keys/values are ``[W_K H_ctx ; W_K H_d]`` (eq. 3).

    With ``config.qk_norm`` (v2), queries and keys (block and context keys alike) go through a
    per-head RMSNorm (``q_norm``/``k_norm``, weight ``[head_dim]``, Qwen3 style) before RoPE.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = LlamaRMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = LlamaRMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None

    def _heads(self, x: torch.Tensor, n: int, norm: nn.Module | None = None) -> torch.Tensor:
        """``[B, n, heads*hd]`` -> ``[B, heads, n, hd]``, per-head RMS-normed by ``norm`` when given."""
        x = x.view(*x.shape[:2], n, self.head_dim)
        return (x if norm is None else norm(x)).transpose(1, 2)

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotary keys and values of ``x`` ``[B, n, d]`` -> two ``[B, kv_heads, n, head_dim]``."""
        k = self._heads(self.k_proj(x), self.num_kv_heads, self.k_norm)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(self, x, cos, sin, context_kv, anchors=None):
        """``x`` ``[B, q, d]`` block states attend to ``context_kv`` and to their own block.

        With ``anchors`` ``[B, A]`` (training), ``x`` packs ``A`` blocks of ``γ = q / A`` positions:
        block ``b`` sees context positions ``< anchors[:, b]`` and its own γ positions only.
        """
        q = self._heads(self.q_proj(x), self.num_heads, self.q_norm)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.key_values(x, cos, sin)
        if anchors is None:
            k = torch.cat([context_kv[0], k], dim=2)
            v = torch.cat([context_kv[1], v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.num_kv_heads != self.num_heads)
        else:
            out = self._packed_attention(q, *context_kv, k, v, anchors)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))

    def _packed_attention(self, q, k_ctx, v_ctx, k_blk, v_blk, anchors):
        """Anchor-bounded attention in two parts (context, own block) without a dense ``[q, n + q]`` mask."""
        S, H, Q, hd = q.shape
        A = anchors.shape[1]
        gamma = Q // A
        rep = H // self.num_kv_heads
        k_ctx, v_ctx, k_blk, v_blk = (t.repeat_interleave(rep, dim=1) for t in (k_ctx, v_ctx, k_blk, v_blk))
        scale = hd**-0.5
        n = k_ctx.shape[2]
        visible = torch.arange(n, device=q.device) < anchors.repeat_interleave(gamma, dim=1)[..., None]
        s_ctx = (q @ k_ctx.transpose(-1, -2) * scale).masked_fill(~visible[:, None], float("-inf"))
        qb, kb = q.view(S, H, A, gamma, hd), k_blk.view(S, H, A, gamma, hd)
        s_blk = (qb @ kb.transpose(-1, -2) * scale).view(S, H, Q, gamma)
        p = torch.cat([s_ctx, s_blk], dim=-1).softmax(-1)
        own = p[..., n:].view(S, H, A, gamma, gamma) @ v_blk.view(S, H, A, gamma, hd)
        return p[..., :n] @ v_ctx + own.view(S, H, Q, hd)


class DSparkLayer(nn.Module):
    """Llama-style pre-norm decoder layer (RMSNorm, GQA attention with context injection, SwiGLU)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        llama = _llama_config(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DSparkAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(llama)

    def forward(self, x, cos, sin, context_kv, anchors=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, anchors)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftContext:
    """The drafter's context K/V cache for one request: per layer ``[1, kv_heads, n, head_dim]``.

    It only ever holds positions the target has ACCEPTED (the features of a round's accepted prefix
    are appended after verification), so a rejection never leaves stale entries to crop.
    """

    def __init__(self, num_layers: int):
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.length = 0

    def append(self, kv_per_layer: list[tuple[torch.Tensor, torch.Tensor]], n: int):
        for i, (k, v) in enumerate(kv_per_layer):
            old = self.layers[i]
            self.layers[i] = (k, v) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
        self.length += n


@dataclass
class DraftBlock:
    """One drafted block for one request (γ = ``tokens.numel()``).

    Attributes:
        tokens: ``[γ]`` target-vocabulary ids, sampled left to right from ``logits``.
        logits: ``[γ, V]`` full-vocabulary draft logits after the logits processors (``-inf`` outside
            the draft vocabulary); sampling drew each token from ``softmax(logits[k])``. ``None`` for
            greedy drafting without logits processors (the argmax is taken in the draft vocabulary).
        confidences: ``[γ]`` raw conditional survival probabilities c_k (eq. 7), or ``None``.
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    confidences: torch.Tensor | None


class DSparkDrafter(PreTrainedModel):
    """The DSpark drafter (paper §3): one parallel forward pass drafts a block of γ tokens.

    Inputs of a round: the target's hidden states of the accepted positions (context, eq. 2) and the
    anchor (bonus) token. The block is ``[anchor, mask, ..., mask]`` (γ inputs -> γ draft positions,
    the DSpark variant where the anchor is prediction slot 1). Base logits ``U_k`` come from the
    target's lm_head restricted to the draft vocabulary; the sequential head adds ``B_k`` (eq. 4)
    and the confidence head gives ``c_k``.

    Use :meth:`bind` to attach a target before drafting or training; ``target.generate(...,
    assistant_model=drafter)`` binds automatically.
    """

    config_class = DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "context_features"
    _no_split_modules = ["DSparkLayer"]

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.calibration: SequentialTemperatureScaling | None = None  # STS of the confidences, §3.2.1
        self.last_stats = None  # per-round statistics of the last generate() call
        d, r = config.hidden_size, config.sequential_rank
        vocab = config.draft_vocab_size or config.vocab_size
        v2 = config.dspark_version >= 2
        self.context_proj = nn.Linear(config.context_width, d, bias=False)  # W_c, eq. 2
        self.context_norm = LlamaRMSNorm(d, config.rms_norm_eps)
        # v1: a learned mask vector; v2: the target's frozen embedding of config.mask_token_id
        self.mask_embedding = nn.Parameter(torch.zeros(d)) if config.mask_token_id is None else None
        self.layers = nn.ModuleList(DSparkLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(d, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(_llama_config(config))
        self.token_table = nn.Embedding(vocab + 1, r) if config.uses_token_table else None  # W1
        self.sequential = {"none": lambda: None, "markov": lambda: MarkovHead(r, vocab), "rnn": lambda: RNNHead(d, r, vocab, bias=v2)}[
            config.sequential_head
        ]()
        self.confidence = ConfidenceHead(d, r, bias=v2) if config.confidence_head else None
        self.register_buffer("draft_vocab", torch.arange(vocab), persistent=config.draft_vocab_size is not None)
        self.register_buffer("vocab_index", self._vocab_index(), persistent=False)
        self.post_init()

    # ----------------------------------------------------------------------------------- set-up
    def _vocab_index(self) -> torch.Tensor:
        """``[V]`` map target id -> draft-vocabulary row (``V'`` for tokens outside it)."""
        vocab = self.draft_vocab.numel()
        index = torch.full((self.config.vocab_size,), vocab, dtype=torch.long, device=self.draft_vocab.device)
        index[self.draft_vocab] = torch.arange(vocab, device=self.draft_vocab.device)
        return index

    def set_draft_vocab(self, token_ids: torch.Tensor):
        """Restrict the drafter's outputs to ``token_ids`` (``[V']`` target ids, before training)."""
        if token_ids.numel() != (self.config.draft_vocab_size or self.config.vocab_size):
            raise ValueError("set_draft_vocab: the number of ids must equal config.draft_vocab_size")
        self.draft_vocab.copy_(token_ids.to(self.draft_vocab))
        self.vocab_index = self._vocab_index()

    def _init_weights(self, module):
        """transformers' defaults (normal linears/embeddings, unit norms, RoPE buffers), then zero ``W2``
        so an untrained sequential head adds no bias, and (v1) a small random mask embedding."""
        super()._init_weights(module)
        if isinstance(module, (MarkovHead, RNNHead)):
            init.zeros_(module.w2.weight)
        elif isinstance(module, DSparkDrafter):
            if module.mask_embedding is not None:
                init.normal_(module.mask_embedding, std=self.config.initializer_range)
            init.copy_(module.draft_vocab, torch.arange(module.draft_vocab.numel(), device=module.draft_vocab.device))  # non-persistent when V' = V: from_pretrained leaves it uninitialised

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a drafter (local folder or Hub id) and, when present, its ``calibration.json``."""
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only") if k in kwargs}
        file = cached_file(
            pretrained_model_name_or_path, CALIBRATION_FILE, _raise_exceptions_for_missing_entries=False, **hub
        )
        if file is not None:
            model.calibration = SequentialTemperatureScaling.load(file)
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save config + safetensors (shared target weights excluded) and ``calibration.json`` if fitted."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if self.calibration is not None:
            self.calibration.save(save_directory)

    @property
    def sps_curve(self):
        """The target's SPS curve the scheduler uses: set by :meth:`set_sps_curve`, or profiled (and
        cached on disk) by the first ``generate`` call in ``scheduler`` or ``async`` mode; ``None`` before that."""
        return self.__dict__.get("_sps_curve")

    def set_sps_curve(self, curve):
        """Use ``curve`` (an :class:`~dspark_hf.profiling.SPSCurve`) instead of profiling."""
        self.__dict__["_sps_curve"] = curve

    @property
    def is_bound(self) -> bool:
        return "_shared" in self.__dict__

    def bind(self, target) -> "DSparkDrafter":
        """Attach ``target``'s frozen embedding and lm_head (referenced, not copied or saved).

        Also moves the drafter to the target's device and dtype. Binding the same target twice is free.
        Works inside ``torch.inference_mode()`` and ``torch.no_grad()``: the shared rows are normal tensors.

        Raises:
            TypeError: the target's lm_head has no floating-point ``[V, d]`` weight tensor (e.g. a
                ``torch.ao`` int8 dynamically quantized ``Linear``): the drafter reads its rows (paper §2.2);
                or the target has dynamically quantized layers (their logits are not row-independent).
            ValueError: vocabulary size, hidden size or context layers do not fit ``target`` (the
                message names the fix: train a drafter for this target).
        Warns:
            UserWarning: the target's name differs from ``config.target_name_or_path``.
        """
        self.vocab_index = self._vocab_index()  # derived buffer: not in the checkpoint
        if self.__dict__.get("_bound_target") is target:
            return self
        tc = target.config.get_text_config()
        head, embed = target.get_output_embeddings(), target.get_input_embeddings()
        weight = _lm_head_weight(head)
        _check_row_independent(target)
        fix = "Use a drafter trained for this target, or train one with `dspark train`."
        if weight.shape[0] != self.config.vocab_size:
            raise ValueError(f"Vocabulary mismatch: target lm_head has {weight.shape[0]} rows, drafter expects {self.config.vocab_size}. {fix}")
        if tc.hidden_size != self.config.hidden_size:
            raise ValueError(f"Hidden-size mismatch: target d={tc.hidden_size}, drafter d={self.config.hidden_size}. {fix}")
        if max(self.config.target_layer_ids) >= tc.num_hidden_layers:
            raise ValueError(f"Context layers {self.config.target_layer_ids} exceed the target's {tc.num_hidden_layers} layers. {fix}")
        name = tc._name_or_path
        if self.config.target_name_or_path and name and name != self.config.target_name_or_path:
            warnings.warn(f"Drafter was trained for {self.config.target_name_or_path!r} but is bound to {name!r}; acceptance may be low.")
        # inference_mode(False): under `torch.inference_mode()` new tensors would be inference tensors, which
        # have no version counter (the packed kernels key on it) and cannot be used by later training.
        with torch.inference_mode(False), torch.no_grad():
            self.to(device=weight.device, dtype=weight.dtype)
            rows = weight if self.draft_vocab.numel() == weight.shape[0] else weight[self.draft_vocab]
            packed = None
            if is_prepacked(head):  # CPU: the target's kernels (dspark_hf.kernels); all rows: reuse the head's packed copy
                packed = getattr(head, PACKED_ATTR) if rows is weight else PackedWeight(rows)
        self.__dict__["_shared"] = (embed, rows.detach(), packed)
        self.__dict__["_bound_target"] = target  # last: a failed bind leaves the drafter unbound
        return self

    def _require_bound(self):
        if not self.is_bound:
            raise RuntimeError("The drafter is not bound to a target: call `drafter.bind(target)` first.")

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids ``[...]`` -> the target's (frozen) input embeddings ``[..., d]``."""
        self._require_bound()
        return self.__dict__["_shared"][0](ids)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``U_k``: drafter states ``[..., d]`` -> draft-vocabulary logits ``[..., V']`` (frozen lm_head rows)."""
        self._require_bound()
        _, rows, packed = self.__dict__["_shared"]
        return hidden @ rows.T if packed is None else packed.linear(hidden, rows)

    # --------------------------------------------------------------------------------- backbone
    def encode_context(self, features: torch.Tensor) -> torch.Tensor:
        """Eq. 2: ``[B, n, m*d]`` concatenated target hidden states -> ``H_ctx`` ``[B, n, d]``."""
        if features.shape[-1] != self.config.context_width:
            raise ValueError(
                f"Context features have width {features.shape[-1]}, expected {self.config.context_width} "
                f"(= {len(self.config.target_layer_ids)} layers x {self.config.hidden_size})"
            )
        return self.context_norm(self.context_proj(features.to(self.context_proj.weight.dtype)))

    def context_key_values(self, features: torch.Tensor, positions: torch.Tensor):
        """Per-layer context keys/values of ``features`` ``[B, n, m*d]`` at ``positions`` ``[B, n]``."""
        h = self.encode_context(features)
        cos, sin = self.rotary_emb(h, positions)
        return [layer.self_attn.key_values(h, cos, sin) for layer in self.layers]

    def backbone(self, block_embeds, positions, context_kv, anchors=None) -> torch.Tensor:
        """Parallel stage: ``block_embeds`` ``[B, q, d]`` at ``positions`` ``[B, q]`` -> ``h`` ``[B, q, d]``.

        ``anchors`` ``[B, A]`` switches to packed training blocks (see ``DSparkAttention.forward``).
        """
        cos, sin = self.rotary_emb(block_embeds, positions)
        x = block_embeds
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, cos, sin, kv, anchors)
        return self.norm(x)

    def block_embeddings(self, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
        """``anchors`` ``[...]`` -> ``[..., γ, d]``: anchor embedding followed by γ-1 mask embeddings.

        The mask slots hold the target's frozen embedding of ``config.mask_token_id`` (v2) or the
        learned ``mask_embedding`` (v1).
        """
        first = self.embed_tokens(anchors).unsqueeze(-2).to(self.context_proj.weight.dtype)
        masks = self.mask_vector().expand(*anchors.shape, block_size - 1, -1)
        return torch.cat([first, masks], dim=-2)

    def mask_vector(self) -> torch.Tensor:
        """``[d]`` input of every mask slot: the target's embedding of ``config.mask_token_id`` (v2) or
        the learned ``mask_embedding`` (v1), in the drafter's dtype."""
        if self.mask_embedding is not None:
            return self.mask_embedding
        mask_id = torch.tensor(self.config.mask_token_id, device=self.context_proj.weight.device)
        return self.embed_tokens(mask_id).to(self.context_proj.weight.dtype)

    def token_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """``W1[x]`` for target ids ``[...]`` -> ``[..., r]`` (out-of-draft-vocab ids share one row)."""
        return self.token_table(self.vocab_index[ids])

    # ------------------------------------------------------------------------- training forward
    def forward(self, context_features, anchor_positions, block_tokens, context_lengths=None):
        """Teacher-forced forward over many blocks per sequence (anchor-bounded packing, §3.3).

        Args:
            context_features: ``[S, n, m*d]`` target features of each sequence (zero-padded).
            anchor_positions: ``[S, A]`` position ``a`` of each block's anchor; block ``b`` sees
                context positions ``< a_b`` only, and its own γ positions bidirectionally.
            block_tokens: ``[S, A, γ+1]`` target ids ``x_0`` (anchor) ... ``x_γ`` (ground truth).

        Returns:
            :class:`DraftOutput` with ``logits`` ``[S, A, γ, V']`` (``U + B``), ``confidence_logits``
            ``[S, A, γ]`` (or ``None``) and ``hidden`` ``[S, A, γ, d]``.
        """
        S, n, _ = context_features.shape
        A, gamma = anchor_positions.shape[1], block_tokens.shape[-1] - 1
        ctx_pos = torch.arange(n, device=context_features.device).expand(S, n)
        context_kv = self.context_key_values(context_features, ctx_pos)
        offsets = torch.arange(gamma, device=anchor_positions.device)
        positions = (anchor_positions[..., None] + offsets).reshape(S, A * gamma)
        embeds = self.block_embeddings(block_tokens[..., 0], gamma).reshape(S, A * gamma, -1)
        hidden = self.backbone(embeds, positions, context_kv, anchor_positions)
        hidden = hidden.view(S, A, gamma, -1)
        return self.heads(hidden, block_tokens[..., :gamma])

    def heads(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> "DraftOutput":
        """Sequential + confidence heads with teacher forcing.

        ``hidden`` ``[..., γ, d]``; ``prev_tokens`` ``[..., γ]`` = ``x_0 ... x_{γ-1}``.
        """
        logits = self.base_logits(hidden)
        prev = self.token_embedding(prev_tokens) if self.token_table is not None else None
        if isinstance(self.sequential, MarkovHead):
            logits = logits + self.sequential(prev)
        elif isinstance(self.sequential, RNNHead):
            state, biases = self.sequential.initial_state(hidden[..., 0, :]), []
            for k in range(hidden.shape[-2]):
                state, bias = self.sequential(state, prev[..., k, :], hidden[..., k, :])
                biases.append(bias)
            logits = logits + torch.stack(biases, dim=-2)
        conf = self.confidence(hidden, prev) if self.confidence is not None else None
        return DraftOutput(logits=logits, confidence_logits=conf, hidden=hidden)

    # ------------------------------------------------------------------------------- inference
    def new_context(self) -> DraftContext:
        """An empty context cache for one request."""
        return DraftContext(len(self.layers))

    @torch.no_grad()
    def extend_context(self, context: DraftContext, features: torch.Tensor):
        """Append the accepted positions' target features ``[1, n_new, m*d]`` to ``context``."""
        n_new = features.shape[1]
        positions = torch.arange(context.length, context.length + n_new, device=features.device)[None]
        context.append(self.context_key_values(features, positions), n_new)

    @torch.no_grad()
    def draft(self, context: DraftContext, anchor: int, block_size: int | None = None, do_sample=False,
              logits_processor=None, prefix_ids: torch.Tensor | None = None, generator=None,
              forced_tokens: torch.Tensor | None = None) -> DraftBlock:
        """Draft one block after ``context`` (paper Fig. 1): one backbone pass, then left-to-right heads.

        Args:
            context: cache holding the features of every position before the anchor.
            anchor: the anchor (bonus) token id, at position ``context.length``.
            block_size: γ for this round (default ``config.block_size``).
            do_sample: sample each ``x_k`` from ``softmax(logits_k)``; else argmax.
            logits_processor: a ``LogitsProcessorList`` applied to each position's full-vocab logits
                (given ``prefix_ids`` ``[1, L]`` + the drafts so far), as the target applies it.
            forced_tokens: ``[k]`` ids (``k < γ``) taken as the first k drafts instead of drafting them (prompt
                lookup tokens, :mod:`dspark_hf.lookup`); later positions are drafted with them as previous
                tokens (heads, eqs. 4-7). Their logits rows are one-hot (0 at the id, ``-inf`` elsewhere): the
                deterministic proposal they are.

        Returns:
            :class:`DraftBlock` (``tokens`` ``[γ]``, ``logits`` ``[γ, V]``, ``confidences`` ``[γ]``).

        Raises:
            ValueError: ``forced_tokens`` leaves no position to draft.
        """
        gamma = block_size or self.config.block_size
        device = self.context_proj.weight.device
        forced = forced_tokens.reshape(-1).to(device) if forced_tokens is not None else None
        n_forced = forced.numel() if forced is not None else 0
        if n_forced >= gamma:
            raise ValueError(f"forced_tokens must leave a position to draft: {n_forced} forced, block size {gamma}")
        anchor_t = torch.tensor([anchor], device=device)
        positions = torch.arange(context.length, context.length + gamma, device=device)[None]
        hidden = self.backbone(self.block_embeddings(anchor_t, gamma), positions, context.layers)[0]  # [γ, d]
        base = self.base_logits(hidden)  # [γ, V']
        state = self.sequential.initial_state(hidden[0]) if isinstance(self.sequential, RNNHead) else None
        ids = prefix_ids if prefix_ids is not None else anchor_t[None]
        processors = logits_processor if logits_processor is not None and len(logits_processor) > 0 else None
        full_vocab = do_sample or processors is not None
        prev, tokens, logits, confs = anchor_t[0], [], [], []
        for k in range(gamma):
            emb = self.token_embedding(prev) if self.token_table is not None else None
            row = base[k]
            if isinstance(self.sequential, MarkovHead):
                row = row + self.sequential(emb)
            elif isinstance(self.sequential, RNNHead):
                state, bias = self.sequential(state, emb, hidden[k])
                row = row + bias
            if k < n_forced:
                prev = forced[k]
                if full_vocab:
                    one_hot = F.one_hot(prev, self.config.vocab_size)  # as the drafted rows: float after processors
                    logits.append(one_hot.to(torch.float32 if processors is not None else row.dtype).log())
            elif full_vocab:
                full = row.new_full((self.config.vocab_size,), float("-inf"))
                full[self.draft_vocab] = row
                if processors is not None:
                    full = processors(ids, full[None].float())[0]
                prev = torch.multinomial(full.float().softmax(-1), 1, generator=generator)[0] if do_sample else full.argmax()
                logits.append(full)
            else:
                prev = self.draft_vocab[row.argmax()]
            if self.confidence is not None:
                confs.append(torch.sigmoid(self.confidence(hidden[k], emb)))
            tokens.append(prev)
            if processors is not None:
                ids = torch.cat([ids, prev.view(1, 1)], dim=-1)
        return DraftBlock(
            tokens=torch.stack(tokens),
            logits=torch.stack(logits) if logits else None,
            confidences=torch.stack(confs) if confs else None,
        )


@dataclass
class DraftOutput:
    """Training outputs: ``logits`` ``[..., γ, V']`` (U + B), ``confidence_logits`` ``[..., γ]``, ``hidden``."""

    logits: torch.Tensor
    confidence_logits: torch.Tensor | None
    hidden: torch.Tensor


def _route_remote_copy() -> None:
    """This file also ships with each drafter for ``trust_remote_code`` (``hub.py``). Loaded that way, import the
    installed ``dspark_hf`` so ``target.generate(assistant_model=drafter)`` is routed as after ``import dspark_hf``."""
    if not __package__ or __package__.split(".")[0] == "dspark_hf":
        return
    try:
        import dspark_hf  # noqa: F401  (importing it installs the generate() routing)
    except ImportError:
        warnings.warn("This DSpark drafter was loaded with trust_remote_code, but generate(assistant_model=drafter) "
                      "needs the dspark-hf package to route it: pip install dspark-hf.")


_route_remote_copy()
