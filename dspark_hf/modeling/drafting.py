"""Drafting at inference: the heads of one block left to right, and the padded contexts of several requests.

Used by :meth:`~dspark_hf.modeling.modeling_dspark.DSparkDrafter.draft` (one request) and
:meth:`~dspark_hf.modeling.modeling_dspark.DSparkDrafter.draft_many` (one backbone pass for many). Paper §3.1
(eqs. 4-6) and §3.2.1 (eq. 7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def sample_blocks(drafter, hidden: torch.Tensor, anchors: torch.Tensor, do_sample=False, logits_processor=None,
                  prefix_ids: list[torch.Tensor] | None = None, generator=None,
                  forced_tokens: torch.Tensor | None = None) -> list[DraftBlock]:
    """The heads of ``R`` blocks, left to right and all rows at once (eqs. 4-7).

    Args:
        hidden: ``[R, γ, d]`` backbone states; anchors: ``[R]`` anchor ids.
        do_sample / generator: as :meth:`~dspark_hf.modeling.modeling_dspark.DSparkDrafter.draft`.
        logits_processor: as ``draft`` (one for all rows), or a ``list`` of one callable per row.
        prefix_ids: each row's ``[1, L_r]`` ids (read with ``logits_processor``; default: the anchor alone).
        forced_tokens: ``[k]`` ids forced as the first drafts (``R = 1`` only; prompt lookup).

    Returns:
        ``R`` :class:`DraftBlock` (``tokens [γ]``, ``logits [γ, V]`` or ``None``, ``confidences [γ]`` or ``None``).
    """
    rows, gamma = hidden.shape[:2]
    forced = forced_tokens.reshape(-1).to(hidden.device) if forced_tokens is not None else anchors[:0]  # [k] ids
    base = drafter.base_logits(hidden)  # [R, γ, V']
    head = drafter.sequential
    state = head.initial_state(hidden[:, 0]) if head is not None else None
    processors = logits_processor if logits_processor is not None and len(logits_processor) > 0 else None
    ids = None  # each row's ids so far, read by its logits processor
    if processors is not None:
        processors = processors if type(processors) is list else [processors] * rows  # one per row
        ids = list(prefix_ids) if prefix_ids is not None else [a.view(1, 1) for a in anchors]
    full_vocab = do_sample or processors is not None
    prev, tokens, logits, confs = anchors, [], [], []
    for k in range(gamma):
        emb = drafter.token_embedding(prev) if drafter.token_table is not None else None  # [R, r]
        row = base[:, k]  # [R, V']
        if head is not None:
            state, bias = head.step(state, emb, hidden[:, k])
            row = row + bias  # U_k + B_k, eq. 4
        if k < forced.numel():
            prev = forced[k].expand(rows)
            full = F.one_hot(prev, drafter.config.vocab_size).float().log() if full_vocab else None
        elif full_vocab:
            full = _full_vocab_logits(drafter, row, processors, ids)
            prev = torch.multinomial(full.softmax(-1), 1, generator=generator)[:, 0] if do_sample else full.argmax(-1)
        else:
            prev, full = drafter.draft_vocab[row.argmax(-1)], None
        if full is not None:
            logits.append(full)
        if drafter.confidence is not None:
            confs.append(torch.sigmoid(drafter.confidence(hidden[:, k], emb)))  # [R]
        tokens.append(prev)
        if processors is not None:
            ids = [torch.cat([ids[r], prev[r].view(1, 1)], dim=-1) for r in range(rows)]
    return _blocks(tokens, logits, confs)


def _full_vocab_logits(drafter, row: torch.Tensor, processors, ids) -> torch.Tensor:
    """Draft-vocabulary logits ``row`` ``[R, V']`` -> float32 ``[R, V]`` (``-inf`` outside the draft vocabulary),
    each row through its logits processor (given its ids so far) when ``processors`` is given. float32 in every
    dtype: the q sampled from is the softmax of the very row returned."""
    full = row.new_full((row.shape[0], drafter.config.vocab_size), float("-inf"), dtype=torch.float32)  # [R, V]
    full[:, drafter.draft_vocab] = row.float()
    if processors is not None:
        full = torch.cat([processors[r](ids[r], full[r:r + 1]) for r in range(row.shape[0])])
    return full


def warm_up(drafter, block_size: int) -> None:
    """Draft one throwaway block of ``block_size`` drafts after a context of ``block_size + 1`` zero-feature
    positions, once per drafter and block size, so that no decoding round is the one that pays the kernels' one-time
    set-up.

    A process's first drafter pass sets up the kernels of its shapes (oneDNN primitives, first touches of new
    buffers): 9.6 ms against 4.5-5 ms for the next ones (the shipped drafter, γ = 7, 1 thread, a 2-core AVX-512 EPYC).
    The decoders price a pass by the passes they time (:meth:`~dspark_hf.runtime.sps.SPSCurve.observe_round`, an
    average that takes its first measurement as it is), so that first pass made a fresh process price drafting at
    ~2× its cost for the rest of its first call. Greedy and on a context of its own: no random numbers are drawn and
    nothing is kept, so decoding is unchanged.

    Args:
        drafter: a bound :class:`~dspark_hf.modeling.modeling_dspark.DSparkDrafter` (its kernels already chosen:
            :func:`~dspark_hf.runtime.kernels.prepack_like`).
        block_size: γ of the calls to come.
    """
    warm = getattr(drafter, "_warm_block_sizes", None)
    if warm is None:
        warm = drafter._warm_block_sizes = set()
    if block_size in warm:
        return
    weight = drafter.context_proj.weight
    with torch.no_grad():
        context = drafter.new_context()
        drafter.extend_context(context, weight.new_zeros(1, block_size + 1, weight.shape[1]))
        drafter.draft(context, 0, block_size)
    warm.add(block_size)


def _blocks(tokens: list, logits: list, confs: list) -> list[DraftBlock]:
    """Per-position lists (``γ`` of ``[R]``, ``[R, V]``, ``[R]``; the last two may be empty) -> ``R`` blocks."""
    tokens = torch.stack(tokens, dim=1)  # [R, γ]
    logits = torch.stack(logits, dim=1) if logits else None  # [R, γ, V]
    confs = torch.stack(confs, dim=1) if confs else None  # [R, γ]
    return [DraftBlock(tokens=tokens[r], logits=logits[r] if logits is not None else None,
                       confidences=confs[r] if confs is not None else None) for r in range(tokens.shape[0])]
