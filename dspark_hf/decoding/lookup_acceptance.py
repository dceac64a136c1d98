"""How much a prompt-lookup draft is worth: the online acceptance estimate of one ``generate`` call
(:class:`LookupAcceptance`) and its prior, learnt across the calls of one drafter (:class:`LookupPrior`, issue #28).

The round planner (:mod:`dspark_hf.decoding.lookup`) weighs a lookup continuation by ``Θ = τ · rate(B)`` (paper
§3.2.2), ``τ`` built from these conditionals exactly as the DSpark side builds it from the calibrated confidences
(§3.2.1). A call used to start from Beta(1, 1), i.e. 1/2 for an n-gram continuation, so a short answer ended before
its own rounds had taught it what lookups were worth; now it starts from what the same drafter's earlier calls
measured (an empirical-Bayes prior with the same strength ``α + β``). Lossless as before: only verified rounds feed
either estimate, a call reads earlier calls' counts and its own verified rounds, never a draft of its own round
(Appendix A), and the prior changes only the plan, never what a verification accepts.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lookup import LookupMatch

__all__ = ["MAX_NGRAM", "LookupAcceptance", "LookupPrior", "lookup_prior", "reset_lookup_prior"]

MAX_NGRAM = 8  # longest suffix compared, and the last match-length bucket of the acceptance estimate
PRIOR_CALLS = 8  # the cross-call prior pools the most recent this many calls of a drafter
PRIOR_CALL_CAP = 16  # ... each weighing at most this many observations per kind (a long answer weighs as much as
# a capped one), so one prompt moves the next call's prior by at most 16 / (16 · 8) once the window is full

_PRIORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> {sampling: LookupPrior}


class LookupPrior:
    """The lookup acceptance of a drafter's recent ``generate`` calls: the prior mean a new call's
    :class:`LookupAcceptance` starts from, first continuation tokens and later ones apart.

    ``p = (Σ_c w_c·a_c + α) / (Σ_c w_c·(a_c + r_c) + α + β)`` over the last ``window`` calls ``c`` with ``a_c``
    accepted and ``r_c`` rejected lookup tokens of that kind (verified rounds only), ``w_c = min(1, cap / (a_c +
    r_c))``. With no earlier call it is ``α / (α + β)``, today's 1/2.

    Args:
        prior: ``(α, β)``, the Beta prior of the cross-call mean and, through ``α + β``, the strength of the mean in
            a call (:class:`LookupAcceptance`).
        window: calls pooled (older ones are forgotten).
        cap: observations per kind one call weighs at most.
    """

    def __init__(self, prior: tuple[float, float] = (1.0, 1.0), window: int = PRIOR_CALLS, cap: int = PRIOR_CALL_CAP):
        self.prior, self.cap = prior, cap
        self.calls: deque[dict[bool, list[int]]] = deque(maxlen=window)  # each call's live pooled counts

    @property
    def strength(self) -> float:
        """``α + β``: pseudo-observations the prior mean weighs in a call."""
        return sum(self.prior)

    def means(self) -> dict[bool, float]:
        """``{first token?: p}`` from the calls joined so far (formula above)."""
        out = {}
        for first in (True, False):
            accepted = seen = 0.0
            for call in list(self.calls):  # a snapshot: another thread's call may join meanwhile
                a, r = call[first]
                weight = min(1.0, self.cap / (a + r)) if a + r else 0.0
                accepted, seen = accepted + weight * a, seen + weight * (a + r)
            out[first] = (accepted + self.prior[0]) / (seen + self.strength)
        return out

    def join(self, pooled: dict[bool, list[int]]) -> dict[bool, float]:
        """A new call's prior means (:meth:`means` of the earlier calls), then its live ``pooled`` counts
        ``{first token?: [accepted, rejected]}`` join the window for the calls after it."""
        means = self.means()
        self.calls.append(pooled)
        return means

    def reset(self) -> None:
        """Forget every earlier call: the next call starts from ``α / (α + β)``."""
        self.calls.clear()


def lookup_prior(drafter, sampling: bool) -> LookupPrior:
    """The :class:`LookupPrior` ``generate`` calls with ``drafter`` share, greedy and sampled calls apart (a sampled
    token matches a lookup token less often than the argmax does). Shared by threads; lives as long as the drafter."""
    table = _PRIORS.setdefault(drafter, {})
    return table.setdefault(bool(sampling), LookupPrior())


def reset_lookup_prior(drafter) -> None:
    """Forget what ``drafter``'s earlier calls taught the lookup estimate (both kinds of call): e.g. before a
    benchmark that must not depend on the prompts run before it."""
    _PRIORS.pop(drafter, None)


class LookupAcceptance:
    """Online estimate of ``P(lookup draft i accepted | drafts < i accepted)`` per effective match length.

    A posterior mean per bucket ``min(n + i - 1, max_ngram)`` (``n`` = match length, ``i`` = continuation
    position, 1-based) whose prior is a pooled rate: ``(accepted_b + s·p) / (accepted_b + rejected_b + s)``,
    ``p = (A + s·p₀) / (A + R + s)``, ``s = α + β``, with ``A``, ``R`` the accepted / rejected counts over all buckets
    of the same kind of position (first continuation tokens, ``i = 1``, apart from later ones: one long accepted
    run must not vouch for the next first token) and ``p₀`` the prior mean of that kind from earlier calls
    (:meth:`LookupPrior.join`; ``α / s`` without a :class:`LookupPrior`). With no data it is ``p₀``; a bucket never
    seen follows what the generation's other lengths were worth.

    Args:
        max_ngram: the last match-length bucket.
        prior: the :class:`LookupPrior` this call joins (its counts feed the calls after it), or ``None``: a fresh
            one (Beta(1, 1), nothing learnt).
    """

    def __init__(self, max_ngram: int = MAX_NGRAM, prior: LookupPrior | None = None):
        prior = prior if prior is not None else LookupPrior()
        self.max_ngram = max_ngram
        self.strength = prior.strength
        self.accepted = [0] * (max_ngram + 1)  # index = bucket (0 unused)
        self.rejected = [0] * (max_ngram + 1)
        self.pooled = {True: [0, 0], False: [0, 0]}  # first token or not -> [accepted, rejected]
        self.prior_means = prior.join(self.pooled)  # {first token?: p₀}, fixed for the call

    def bucket(self, match_length: int, position: int) -> int:
        return min(match_length + position - 1, self.max_ngram)

    def conditionals(self, match: LookupMatch) -> list[float]:
        """Estimated conditional acceptance ``c_i`` of each continuation token, ``len(match.tokens)`` values."""
        s = self.strength
        prior = {first: s * (a + s * self.prior_means[first]) / (a + r + s) for first, (a, r) in self.pooled.items()}
        out = []
        for i in range(1, len(match.tokens) + 1):
            b = self.bucket(match.match_length, i)
            out.append((self.accepted[b] + prior[i == 1]) / (self.accepted[b] + self.rejected[b] + s))
        return out

    def update(self, match: LookupMatch, produced: Sequence[int]) -> None:
        """Score ``match``'s continuation against the tokens a round produced (its accepted drafts + the target's
        token): token ``i`` counts while the previous ones agreed and ``produced`` reaches position ``i``."""
        for i, (proposed, actual) in enumerate(zip(match.tokens, produced), start=1):
            b, pool = self.bucket(match.match_length, i), self.pooled[i == 1]
            if proposed != actual:
                self.rejected[b] += 1
                pool[1] += 1
                return
            self.accepted[b] += 1
            pool[0] += 1
