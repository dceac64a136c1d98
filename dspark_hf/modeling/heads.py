"""Sequential heads (paper §3.1, eqs. 4-6) and the confidence head (§3.2.1, eq. 7).

All heads work in the drafter's output vocabulary of size ``V'`` and share the token table ``W1``
(``[V' + 1, r]``; the last row stands for every target token outside the draft vocabulary).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """Low-rank first-order transition bias ``B(x_{k-1}, ·) = W1[x_{k-1}] W2`` (eq. 5).

    ``W2`` starts at zero, so an untrained head leaves the parallel logits unchanged.
    """

    def __init__(self, rank: int, vocab: int):
        super().__init__()
        self.w2 = nn.Linear(rank, vocab, bias=False)

    def forward(self, prev_embedding: torch.Tensor) -> torch.Tensor:
        """``prev_embedding`` ``[..., r]`` (= ``W1[x_{k-1}]``) -> bias ``[..., V']``."""
        return self.w2(prev_embedding)


class RNNHead(nn.Module):
    """Gated recurrent transition bias (eq. 6).

    ``z_k = [s_{k-1}; W1[x_{k-1}]; h_k]``; one linear map gives gate, candidate and output parts;
    ``s_k = σ(g) ⊙ s_{k-1} + (1 - σ(g)) ⊙ tanh(c)`` and ``B_k = tanh(o) W2``, with ``s_0 = 0``.
    ``bias``: the joint projection has a bias (v2, as the reference heads); v1 drafters have none.
    """

    def __init__(self, hidden: int, rank: int, vocab: int, bias: bool = True):
        super().__init__()
        self.rank = rank
        self.gates = nn.Linear(2 * rank + hidden, 3 * rank, bias=bias)
        self.w2 = nn.Linear(rank, vocab, bias=False)

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
