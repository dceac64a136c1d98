"""The drafter's parallel backbone: Llama-style decoder layers whose attention also reads the target's context.

Paper §2.2 (eq. 3): each layer's keys/values are ``[W_K H_ctx ; W_K H_d]``, the projected context features
followed by the block's own states. Built from transformers' Llama pieces (RMSNorm, SwiGLU MLP, RoPE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from .configuration_dspark import DSparkConfig


def _llama_config(config: DSparkConfig) -> LlamaConfig:
    """The Llama pieces' config (SwiGLU MLP, RoPE): :meth:`DSparkConfig.layer_config`."""
    return LlamaConfig(**config.layer_config())


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

    def forward(self, x, cos, sin, context_kv, anchors=None, context_mask=None):
        """``x`` ``[B, q, d]`` block states attend to ``context_kv`` and to their own block.

        With ``anchors`` ``[B, A]`` (training), ``x`` packs ``A`` blocks of ``γ = q / A`` positions:
        block ``b`` sees context positions ``< anchors[:, b]`` and its own γ positions only.
        ``context_mask`` ``[B, n]`` (bool, inference): which context positions each row sees (rows of several
        requests with padded contexts, :meth:`~dspark_hf.modeling.modeling_dspark.DSparkDrafter.draft_many`).
        """
        q = self._heads(self.q_proj(x), self.num_heads, self.q_norm)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.key_values(x, cos, sin)
        if anchors is None:
            k = torch.cat([context_kv[0], k], dim=2)
            v = torch.cat([context_kv[1], v], dim=2)
            mask = None
            if context_mask is not None:  # [B, n] -> [B, 1, 1, n + q]: the own block is always visible
                own = context_mask.new_ones(context_mask.shape[0], x.shape[1])
                mask = torch.cat([context_mask, own], dim=-1)[:, None, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
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

    def forward(self, x, cos, sin, context_kv, anchors=None, context_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, anchors, context_mask)
        return x + self.mlp(self.post_attention_layernorm(x))
