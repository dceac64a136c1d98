"""`DSparkDrafter`: a DFlash-style parallel backbone with sequential and confidence heads.

Paper §2.2 (context injection, eqs. 2-3), §3.1 (semi-autoregressive drafting, eqs. 4-6) and §3.2.1
(confidence, eq. 7). The drafter shares the target's token embedding and lm_head: they are attached
by :meth:`DSparkDrafter.bind`, never copied into the drafter's parameters or its checkpoint.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils.hub import cached_file

from .backbone import DSparkLayer, _llama_config
from .configuration_dspark import DSparkConfig
from .drafting import pad_contexts, sample_blocks
from .heads import ConfidenceHead, build_sequential_head
from .outputs import DraftBlock, DraftContext, DraftOutput
from .state import BoundTarget, DrafterExtensions, set_thread_last_stats, thread_last_stats
from .target_checks import check_row_independent, lm_head_weight

CALIBRATION_FILE = "calibration.json"  # the STS temperatures next to the weights (dspark_hf.decoding.calibration)


EXTENSIONS = DrafterExtensions()  # filled by dspark_hf.wire


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
    bound: BoundTarget | None = None  # set by bind()
    sps_curve: Any = None  # the target's SPS curve (an SPSCurve) the scheduled modes read; set_sps_curve()

    def __init__(self, config: DSparkConfig):
        config.check_mask_token()  # v2: the mask slots' token (a config alone may leave it unset)
        _wire_package()  # the first drafter of a process routes generate (dspark_hf.wire), however it was imported
        super().__init__(config)
        self.calibration = None  # STS of the confidences, §3.2.1 (dspark_hf.decoding.calibration)
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
        table_rows = config.vocab_size if config.full_token_table else vocab + 1
        self.token_table = nn.Embedding(table_rows, r) if config.uses_token_table else None  # W1
        self.sequential = build_sequential_head(config)  # B_k of eq. 4, or None (parallel drafting)
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
        """transformers' defaults (normal linears/embeddings, unit norms, RoPE buffers), then the sequential head's
        own init (:meth:`~dspark_hf.modeling.heads.SequentialHead.init_weights`: ``W2 = 0``, so an untrained head adds
        no bias) and (v1) a small random mask embedding.

        The head is initialised from the drafter's visit (the last, after its children's): transformers skips a
        custom-code module without parameters of its own, such as a head whose weights sit in child linears, and
        its guarded inits leave loaded weights alone."""
        super()._init_weights(module)
        if isinstance(module, DSparkDrafter):
            if module.sequential is not None:
                module.sequential.init_weights()
            if module.mask_embedding is not None:
                init.normal_(module.mask_embedding, std=self.config.initializer_range)
            init.copy_(module.draft_vocab, torch.arange(module.draft_vocab.numel(), device=module.draft_vocab.device))  # non-persistent when V' = V: from_pretrained leaves it uninitialised

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a drafter (local folder or Hub id) and, when present, its ``calibration.json``.

        A speculators- or DeepSpec-format DSpark checkpoint (vLLM, SGLang, SpecForge) is converted on
        load by :func:`dspark_hf.hub.export.import_drafter` (``dtype`` applies; other model kwargs do not).

        Raises:
            FileNotFoundError: the argument looks like a local folder that does not exist (at once, naming
                the directory it was resolved against; :func:`~dspark_hf.defaults.check_local_path`).
            ValueError: its ``config.json`` is another model's (e.g. the target's ``"llama"``), in no format
                :func:`~dspark_hf.hub.export.import_drafter` converts.
        """
        if EXTENSIONS.check_path is not None:
            EXTENSIONS.check_path(pretrained_model_name_or_path, "drafter")
        hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only") if k in kwargs}
        config_file = cached_file(pretrained_model_name_or_path, "config.json", _raise_exceptions_for_missing_entries=False, **hub)
        if config_file is not None:
            config_dict = json.loads(Path(config_file).read_text())
            if EXTENSIONS.import_checkpoint is not None:
                model = EXTENSIONS.import_checkpoint(pretrained_model_name_or_path, config_dict, hub)
                if model is not None:
                    return model.to(kwargs["dtype"]) if kwargs.get("dtype") not in (None, "auto") else model
            model_type = config_dict.get("model_type", DSparkConfig.model_type)
            if model_type != DSparkConfig.model_type:
                raise ValueError(
                    f"{pretrained_model_name_or_path} is not a DSpark drafter (its config.json has model_type "
                    f"{model_type!r}; a target model goes first, as `target`, the drafter as `assistant_model`). Pass a "
                    "DSpark drafter folder or Hub id (e.g. drafters/dspark-smollm2-135m-instruct), or train one with "
                    "`dspark train`.")
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        file = cached_file(
            pretrained_model_name_or_path, CALIBRATION_FILE, _raise_exceptions_for_missing_entries=False, **hub
        )
        if file is not None and EXTENSIONS.load_calibration is not None:
            model.calibration = EXTENSIONS.load_calibration(file)
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save config + safetensors (shared target weights excluded) and ``calibration.json`` if fitted."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if self.calibration is not None:
            self.calibration.save(save_directory)

    def set_sps_curve(self, curve):
        """Use ``curve`` (an :class:`~dspark_hf.runtime.sps.SPSCurve`) as the target's SPS curve: what the scheduled
        modes (``scheduler``, ``async``) and prompt lookup read. ``generate`` resolves a missing one before decoding
        (:func:`~dspark_hf.decoding.candidate_generator.prepare_call`)."""
        self.sps_curve = curve

    @property
    def last_stats(self):
        """The statistics of the last ``generate`` call with this drafter IN THE CALLING THREAD (a
        :class:`~dspark_hf.decoding.stats.GenerationStats`, a ``BatchStats`` for a batch, ``None`` before any):
        per thread (``threading.local``), so threads or server workers sharing one drafter each read their own
        call's; a thread that has run none (``generate`` in a worker, read after ``join``) reads the latest call's.
        A convenience: each call's own object is also ``output.dspark_stats`` with ``return_dict_in_generate=True``.
        Set when a call starts and filled per round; setting ``None`` forgets this thread's."""
        return thread_last_stats(self)

    @last_stats.setter
    def last_stats(self, stats):
        set_thread_last_stats(self, stats)

    @property
    def is_bound(self) -> bool:
        return self.bound is not None

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
        if self.bound is not None and self.bound.model is target:
            return self
        tc = target.config.get_text_config()
        head, embed = target.get_output_embeddings(), target.get_input_embeddings()
        weight = lm_head_weight(head)
        check_row_independent(target)
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
            packed = EXTENSIONS.pack_rows(head, rows, weight) if EXTENSIONS.pack_rows is not None else None  # CPU kernels
        self.bound = BoundTarget(model=target, embed=embed, rows=rows.detach(), packed=packed)  # last: a failed bind leaves it unbound
        return self

    def _require_bound(self):
        if not self.is_bound:
            raise RuntimeError("The drafter is not bound to a target: call `drafter.bind(target)` first.")

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids ``[...]`` -> the target's (frozen) input embeddings ``[..., d]``."""
        self._require_bound()
        return self.bound.embed(ids)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``U_k``: drafter states ``[..., d]`` -> draft-vocabulary logits ``[..., V']`` (frozen lm_head rows)."""
        self._require_bound()
        rows, packed = self.bound.rows, self.bound.packed
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

    def backbone(self, block_embeds, positions, context_kv, anchors=None, context_mask=None) -> torch.Tensor:
        """Parallel stage: ``block_embeds`` ``[B, q, d]`` at ``positions`` ``[B, q]`` -> ``h`` ``[B, q, d]``.

        ``anchors`` ``[B, A]`` switches to packed training blocks (see ``DSparkAttention.forward``);
        ``context_mask`` ``[B, n]`` marks each row's real context positions (padded contexts of several requests).
        """
        cos, sin = self.rotary_emb(block_embeds, positions)
        x = block_embeds
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, cos, sin, kv, anchors, context_mask)
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
        """``W1[x]`` for target ids ``[...]`` -> ``[..., r]`` (out-of-draft-vocab ids share one row unless
        ``config.full_token_table``)."""
        return self.token_table(ids if self.config.full_token_table else self.vocab_index[ids])

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
        if self.sequential is not None:
            logits = logits + self.sequential.block_bias(prev, hidden)
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
                lookup tokens, :mod:`dspark_hf.decoding.lookup`); later positions are drafted with them as previous
                tokens (heads, eqs. 4-7). Their logits rows are one-hot (0 at the id, ``-inf`` elsewhere): the
                deterministic proposal they are.

        Returns:
            :class:`DraftBlock` (``tokens`` ``[γ]``, ``logits`` ``[γ, V]``, ``confidences`` ``[γ]``).

        Raises:
            ValueError: ``forced_tokens`` leaves no position to draft.
        """
        gamma = block_size or self.config.block_size
        device = self.context_proj.weight.device
        if forced_tokens is not None and forced_tokens.numel() >= gamma:
            raise ValueError(f"forced_tokens must leave a position to draft: {forced_tokens.numel()} forced, "
                             f"block size {gamma}")
        anchor_t = torch.tensor([anchor], device=device)
        positions = torch.arange(context.length, context.length + gamma, device=device)[None]
        hidden = self.backbone(self.block_embeddings(anchor_t, gamma), positions, context.layers)  # [1, γ, d]
        return sample_blocks(self, hidden, anchor_t, do_sample, logits_processor,
                             [prefix_ids] if prefix_ids is not None else None, generator, forced_tokens)[0]

    @torch.no_grad()
    def draft_many(self, contexts: list[DraftContext], anchors: list[int], block_size: int | None = None,
                   do_sample=False, logits_processor=None, prefix_ids: list[torch.Tensor] | None = None,
                   generator=None, forced_tokens: torch.Tensor | None = None) -> list[DraftBlock]:
        """One block for each of ``R`` requests in ONE backbone pass (their contexts padded to the longest and
        masked), then each request's heads left to right as in :meth:`draft`.

        Args:
            contexts / anchors: each request's context cache (non-empty) and anchor id.
            prefix_ids: each request's ``[1, L_r]`` ids when ``logits_processor`` is given.
            block_size / do_sample / logits_processor / generator: as :meth:`draft`.
            forced_tokens: as :meth:`draft`, for one request only (``R = 1``: a request alone in flight).

        Returns:
            ``list[DraftBlock]``, one per request, as :meth:`draft` returns it.

        Raises:
            ValueError: ``forced_tokens`` with several requests, or leaving no position to draft.
        """
        gamma = block_size or self.config.block_size
        if forced_tokens is not None and (len(contexts) != 1 or forced_tokens.numel() >= gamma):
            raise ValueError(f"forced_tokens are for one request and must leave a position to draft: "
                             f"{len(contexts)} requests, {forced_tokens.numel()} forced, block size {gamma}")
        device = self.context_proj.weight.device
        layers, mask = pad_contexts(contexts)
        anchor_t = torch.tensor(anchors, device=device)
        positions = torch.stack([torch.arange(c.length, c.length + gamma, device=device) for c in contexts])
        hidden = self.backbone(self.block_embeddings(anchor_t, gamma), positions, layers, context_mask=mask)
        return sample_blocks(self, hidden, anchor_t, do_sample, logits_processor, prefix_ids, generator, forced_tokens)


def _wire_package() -> None:
    """Wire the installed ``dspark_hf`` once (``dspark_hf.wire``: Auto classes, :data:`EXTENSIONS`, ``generate``
    routing), whichever path imported this class: when a drafter is built, and on import of the copy of this file
    that ships with each drafter for ``trust_remote_code`` (``dspark card``), which shares the installed extensions."""
    global EXTENSIONS
    try:
        import dspark_hf
        from dspark_hf.modeling import modeling_dspark as installed
    except ImportError:
        warnings.warn("This DSpark drafter was loaded with trust_remote_code, but generate(assistant_model=drafter) "
                      "needs the dspark-hf package to route it: `pip install -e .` in a clone of its repository.")
        return
    dspark_hf.wire()
    EXTENSIONS = installed.EXTENSIONS


if __package__ and __package__.split(".")[0] != "dspark_hf":  # the remote copy
    _wire_package()
