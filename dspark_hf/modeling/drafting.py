"""Drafting at inference: the heads of one block left to right, and the padded contexts of several requests.

Used by :meth:`~dspark_hf.modeling.modeling_dspark.DSparkDrafter.draft` (one request) and
:meth:`~dspark_hf.modeling.modeling_dspark.DSparkDrafter.draft_many` (one backbone pass for many). Paper §3.1
(eqs. 4-6) and §3.2.1 (eq. 7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .heads import MarkovHead, RNNHead
from .outputs import DraftBlock, DraftContext


def pad_contexts(contexts: list[DraftContext]):
    """Per layer ``(keys, values)`` of ``R`` non-empty contexts, each ``[R, kv_heads, n, head_dim]`` zero-padded
    after its own positions to the longest ``n``, and the mask ``[R, n]`` (bool) of the real positions."""
    longest = max(c.length for c in contexts)
    device = contexts[0].layers[0][0].device
    mask = torch.stack([torch.arange(longest, device=device) < c.length for c in contexts])
    layers = []
    for layer in range(len(contexts[0].buffers)):
        kv = [c.layers[layer] for c in contexts]
        layers.append(tuple(torch.cat([F.pad(t[i], (0, 0, 0, longest - t[i].shape[2])) for t in kv]) for i in (0, 1)))
    return layers, mask


def sample_block(drafter, hidden: torch.Tensor, anchor: int, do_sample, logits_processor, prefix_ids, generator,
                  forced_tokens=None) -> DraftBlock:
    """The heads of one block, left to right (eqs. 4-7): ``hidden`` ``[γ, d]`` -> :class:`DraftBlock`."""
    device = hidden.device
    gamma = hidden.shape[0]
    forced = forced_tokens.reshape(-1).to(device) if forced_tokens is not None else None
    n_forced = forced.numel() if forced is not None else 0
    anchor_t = torch.tensor([anchor], device=device)
    base = drafter.base_logits(hidden)  # [γ, V']
    state = drafter.sequential.initial_state(hidden[0]) if isinstance(drafter.sequential, RNNHead) else None
    ids = prefix_ids if prefix_ids is not None else anchor_t[None]
    processors = logits_processor if logits_processor is not None and len(logits_processor) > 0 else None
    full_vocab = do_sample or processors is not None
    prev, tokens, logits, confs = anchor_t[0], [], [], []
    for k in range(gamma):
        emb = drafter.token_embedding(prev) if drafter.token_table is not None else None
        row = base[k]
        if isinstance(drafter.sequential, MarkovHead):
            row = row + drafter.sequential(emb)
        elif isinstance(drafter.sequential, RNNHead):
            state, bias = drafter.sequential(state, emb, hidden[k])
            row = row + bias
        if k < n_forced:
            prev = forced[k]
            if full_vocab:
                logits.append(F.one_hot(prev, drafter.config.vocab_size).float().log())
        elif full_vocab:  # float32 in every dtype: the q sampled from is softmax of the very row returned
            full = row.new_full((drafter.config.vocab_size,), float("-inf"), dtype=torch.float32)
            full[drafter.draft_vocab] = row.float()
            if processors is not None:
                full = processors(ids, full[None])[0]
            prev = torch.multinomial(full.softmax(-1), 1, generator=generator)[0] if do_sample else full.argmax()
            logits.append(full)
        else:
            prev = drafter.draft_vocab[row.argmax()]
        if drafter.confidence is not None:
            confs.append(torch.sigmoid(drafter.confidence(hidden[k], emb)))
        tokens.append(prev)
        if processors is not None:
            ids = torch.cat([ids, prev.view(1, 1)], dim=-1)
    return DraftBlock(
        tokens=torch.stack(tokens),
        logits=torch.stack(logits) if logits else None,
        confidences=torch.stack(confs) if confs else None,
    )
