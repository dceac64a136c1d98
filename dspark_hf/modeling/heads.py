"""Sequential heads (paper §3.1, eqs. 4-6) and the confidence head (§3.2.1, eq. 7).

All heads work in the drafter's output vocabulary of size ``V'`` and share the token table ``W1``
(``[V' + 1, r]``; the last row stands for every target token outside the draft vocabulary).

A sequential head is one :class:`SequentialHead` subclass registered under its ``config.sequential_head`` name
(:func:`register_head`); the drafter builds it with :func:`build_sequential_head` and calls only the interface
(``initial_state`` / ``step`` at inference, ``block_bias`` in training, ``init_weights``), so a new head is one class.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import initialization as init


class SequentialHead(nn.Module):
    """The transition bias ``B_k`` added to the parallel logits ``U_k`` (eq. 4), one position at a time.

    Shape symbols: ``r`` the rank of ``W1`` / ``W2``, ``d`` the drafter's width, ``V'`` the draft vocabulary.
    A subclass sets ``name`` (its ``config.sequential_head`` value), builds itself from a config
    (:meth:`from_config`) and implements :meth:`step`; it keeps a state between positions when it needs one
    (:meth:`initial_state`). Its bias leaves through ``self.w2`` (``r -> V'``), zeroed by :meth:`init_weights`.
    """

    name: str = ""

    @classmethod
    def from_config(cls, config) -> "SequentialHead":
        """The head of a :class:`~dspark_hf.modeling.configuration_dspark.DSparkConfig`."""
        raise NotImplementedError

    def initial_state(self, like: torch.Tensor) -> Any:
        """The state before position 1, for rows shaped as ``like`` (``[..., d]``); ``None`` for a stateless head."""
        return None

    def step(self, state: Any, prev_embedding: torch.Tensor, hidden: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """One position: ``state``, ``prev_embedding`` ``[..., r]`` (= ``W1[x_{k-1}]``), ``hidden`` ``[..., d]``
        (``h_k``) -> ``(next state, B_k [..., V'])``."""
        raise NotImplementedError

    def block_bias(self, prev_embeddings: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher forcing (training): ``prev_embeddings`` ``[..., γ, r]`` (``W1[x_0 .. x_{γ-1}]``), ``hidden``
        ``[..., γ, d]`` -> ``B`` ``[..., γ, V']``, position by position through :meth:`step`."""
        state, biases = self.initial_state(hidden[..., 0, :]), []
        for k in range(hidden.shape[-2]):
            state, bias = self.step(state, prev_embeddings[..., k, :], hidden[..., k, :])
            biases.append(bias)
        return torch.stack(biases, dim=-2)

    def init_weights(self) -> None:
        """``W2 = 0``: an untrained head adds no bias (the parallel logits unchanged)."""
        init.zeros_(self.w2.weight)


SEQUENTIAL_HEADS: dict[str, type[SequentialHead]] = {}  # config.sequential_head -> class ("none": no head)


def register_head(cls: type[SequentialHead]) -> type[SequentialHead]:
    """Class decorator: make ``cls`` buildable as ``DSparkConfig(sequential_head=cls.name)``.

    Raises:
        ValueError: ``cls.name`` is empty, ``"none"`` or already taken.
    """
    if not cls.name or cls.name == "none" or cls.name in SEQUENTIAL_HEADS:
        raise ValueError(f"a sequential head needs a new name other than 'none', got {cls.name!r} "
                         f"(registered: {sorted(SEQUENTIAL_HEADS)})")
    SEQUENTIAL_HEADS[cls.name] = cls
    return cls


def head_names() -> tuple[str, ...]:
    """Every valid ``config.sequential_head``: ``"none"`` and the registered heads."""
    return ("none", *SEQUENTIAL_HEADS)


def build_sequential_head(config) -> SequentialHead | None:
    """The sequential head ``config.sequential_head`` names, or ``None`` for ``"none"`` (parallel drafting).

    Raises:
        ValueError: an unregistered name.
    """
    if config.sequential_head == "none":
        return None
    if config.sequential_head not in SEQUENTIAL_HEADS:
        raise ValueError(f"sequential_head must be one of {head_names()}, got {config.sequential_head!r}")
    return SEQUENTIAL_HEADS[config.sequential_head].from_config(config)


@register_head
class MarkovHead(SequentialHead):
    """Low-rank first-order transition bias ``B(x_{k-1}, ·) = W1[x_{k-1}] W2`` (eq. 5); stateless.

    ``W2`` starts at zero, so an untrained head leaves the parallel logits unchanged.
    """

    name = "markov"

    def __init__(self, rank: int, vocab: int):
        super().__init__()
        self.w2 = nn.Linear(rank, vocab, bias=False)

    @classmethod
    def from_config(cls, config) -> "MarkovHead":
        return cls(config.sequential_rank, config.draft_vocab_size or config.vocab_size)

    def forward(self, prev_embedding: torch.Tensor) -> torch.Tensor:
        """``prev_embedding`` ``[..., r]`` (= ``W1[x_{k-1}]``) -> bias ``[..., V']``."""
        return self.w2(prev_embedding)

    def step(self, state: None, prev_embedding: torch.Tensor, hidden: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, self(prev_embedding)

    def block_bias(self, prev_embeddings: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """All γ positions in one product (the bias depends on ``x_{k-1}`` alone)."""
        return self(prev_embeddings)


@register_head
class RNNHead(SequentialHead):
    """Gated recurrent transition bias (eq. 6).

    ``z_k = [s_{k-1}; W1[x_{k-1}]; h_k]``; one linear map gives gate, candidate and output parts;
    ``s_k = σ(g) ⊙ s_{k-1} + (1 - σ(g)) ⊙ tanh(c)`` and ``B_k = tanh(o) W2``, with ``s_0 = 0``.
    ``bias``: the joint projection has a bias (v2, as the reference heads); v1 drafters have none.
    """

    name = "rnn"

    def __init__(self, hidden: int, rank: int, vocab: int, bias: bool = True):
        super().__init__()
        self.rank = rank
        self.gates = nn.Linear(2 * rank + hidden, 3 * rank, bias=bias)
        self.w2 = nn.Linear(rank, vocab, bias=False)

    @classmethod
    def from_config(cls, config) -> "RNNHead":
        return cls(config.hidden_size, config.sequential_rank, config.draft_vocab_size or config.vocab_size,
                   bias=config.dspark_version >= 2)

    def initial_state(self, like: torch.Tensor) -> torch.Tensor:
        """``s_0 = 0`` with the leading shape of ``like`` (``[..., d]`` -> ``[..., r]``)."""
        return like.new_zeros(*like.shape[:-1], self.rank)

    def forward(self, state: torch.Tensor, prev_embedding: torch.Tensor, hidden: torch.Tensor):
        """One step: ``state`` ``[..., r]``, ``prev_embedding`` ``[..., r]``, ``hidden`` ``[..., d]``.

        Returns ``(s_k [..., r], B_k [..., V'])``.
        """
        z = torch.cat([state, prev_embedding, hidden], dim=-1)
        gate, candidate, output = self.gates(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return state, self.w2(torch.tanh(output))

    def step(self, state: torch.Tensor, prev_embedding: torch.Tensor, hidden: torch.Tensor):
        return self(state, prev_embedding, hidden)


class ConfidenceHead(nn.Module):
    """``c_k = σ(wᵀ [h_k ; W1[x_{k-1}]] + b)`` (eq. 7): P(draft k survives | drafts < k survived).

    ``bias``: whether ``b`` exists (v2, as the reference heads); v1 drafters have none.
    """

    def __init__(self, hidden: int, rank: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1, bias=bias)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[..., d]``, ``prev_embedding`` ``[..., r]`` -> confidence LOGITS ``[...]``."""
        return self.proj(torch.cat([hidden, prev_embedding], dim=-1)).squeeze(-1)
