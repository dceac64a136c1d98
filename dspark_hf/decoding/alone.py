"""A request alone in flight in the concurrent engine: its steps planned and proposed as the single-request path
plans its rounds with prompt lookup (issue #24; the planner of issue #14, :mod:`dspark_hf.decoding.lookup`).

When one request runs and no prompt is prefilled in the step, :class:`~dspark_hf.decoding.concurrent.ConcurrentDecoder`
asks the request's :class:`AlonePlanner` before anything is drafted, and the step is the round the plan names
(:func:`~dspark_hf.decoding.lookup.plan_round` by the expected throughput ``Θ(ℓ) = (1 + Σ_{j<=ℓ} a_j) · rate(1 + ℓ)``,
paper §3.2.2, with the planner's margin and probes):

* ``"lookup"``: the anchor and the first ℓ tokens of the lookup continuation, no drafter pass (the request's target
  features stay pending until a step drafts); under sampling their proposal logits are one-hot
  (:func:`~dspark_hf.decoding.lookup.one_hot_logits`), so exact speculative sampling accepts a lookup token ``l``
  with probability ``p(l)`` and otherwise resamples from the residual;
* ``"hybrid"``: the drafter's block with its first k drafts forced to the lookup tokens
  (:meth:`~dspark_hf.DSparkDrafter.draft_many` with ``forced_tokens``), ℓ = the plan's;
* ``"dspark"``: the drafter's block, ℓ by the verification mode (Algorithm 1, §5.2), at least one draft in a probe;
* ``"target"``: the anchor alone (a plain decoding step).

The rates are the engine's step costs at R = 1 (:meth:`~dspark_hf.decoding.batch_costs.StepCosts.alone_rates`,
without and with the drafter's pass), the verification read as the single path reads it
(:meth:`~dspark_hf.SPSCurve.round_ms`: the sizes the step can verify). After verification the
lookup estimate scores the continuation against the tokens the step produced (whatever was proposed) and the online
correction hears from the drafter's own verified drafts after the forced ones
(:meth:`~dspark_hf.decoding.calibration.OnlineCorrection.observe_round`, the single path's rule).

Lossless as the single path: the plan reads the accepted text and earlier steps only, never a draft of its own step
(Appendix A); lookup tokens are a deterministic function of the accepted text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..modeling.limits import MAX_BLOCK_SIZE
from ..modeling.outputs import DraftBlock
from .batch_costs import StepCosts
from .calibration import OnlineCorrection
from .lookup import LookupMatch, RoundPlan, RoundPlanner, find_continuation, one_hot_logits
from .lookup_acceptance import LookupAcceptance, LookupPrior

DRAFTER_SOURCES = ("dspark", "hybrid")  # the plans whose step runs the drafter's pass


class AlonePlanner(RoundPlanner):
    """One request's round planner in the engine (scheduled modes): the :class:`RoundPlanner`'s DSpark estimate,
    correction and probes, kept current at every R, plus prompt lookup for the steps it runs alone.

    Args:
        calibration / correction: as :class:`~dspark_hf.decoding.lookup.RoundPlanner`.
        prior: returns the :class:`~dspark_hf.decoding.lookup_acceptance.LookupPrior` of the drafter's calls (greedy
            or sampled) the lookup estimate starts from and feeds, called at the request's first plan (a request
            never alone leaves the shared prior alone); ``None``: no prompt lookup.
    """

    def __init__(self, calibration, correction: OnlineCorrection, prior: Callable[[], LookupPrior] | None):
        super().__init__(calibration, correction)
        self.prior = prior
        self.acceptance: LookupAcceptance | None = None  # the lookup estimate, from the first plan on
        self.match: LookupMatch | None = None  # the lookup continuation of the step in flight

    def plan(self, ids: Sequence[int], costs: StepCosts, context: int, gamma: int, room: int) -> RoundPlan:
        """The plan of a step the request runs alone.

        Args:
            ids: its prompt and generated ids (anchor last).
            costs: the engine's step costs (rates at R = 1 read at ``context``, the tokens in its KV cache).
            gamma: the step's block size (γ capped by the budget); room: draft tokens the budget leaves.

        Returns:
            :class:`~dspark_hf.decoding.lookup.RoundPlan` (``length``: ℓ of a lookup, hybrid or target step); with
            ``gamma < 1`` (one token left) the target alone, unplanned, as the single path's last round.
        """
        if gamma < 1:
            return RoundPlan("target", (), 0)
        if self.prior is not None and self.acceptance is None:
            self.acceptance = LookupAcceptance(prior=self.prior())
        max_tokens = min(MAX_BLOCK_SIZE, costs.sps.max_tokens - 1, room)
        self.match = find_continuation(ids, max_tokens) if self.acceptance is not None else None
        lookup = self.acceptance.conditionals(self.match) if self.match is not None else []
        sizes = max(gamma, len(lookup)) + 1  # the most a plan can verify (a hybrid's k lookup tokens count in γ)
        return self.choose(costs.alone_rates(context, False, sizes), costs.alone_rates(context, True, sizes), gamma,
                           lookup, self.match.tokens if self.match is not None else ())

    def observe_step(self, block: DraftBlock | None, forced: int, scheduled: int, produced: Sequence[int]) -> None:
        """After verification (every step, at any R): a block the drafter drafted (it has confidences; ``None`` or a
        lookup proposal: none) becomes the DSpark estimate and its verified drafts after the ``forced`` lookup
        tokens feed the correction; the step's lookup continuation, if one was planned, is scored against the
        ``produced`` tokens (accepted drafts, then the target's token) of the ``scheduled`` verified."""
        if block is not None and block.confidences is not None:
            self.observe_block(block.confidences)
            self.correction.observe_round(self.block_estimate, forced, scheduled, len(produced) - 1)
        if self.match is not None:
            self.acceptance.update(self.match, produced)
            self.match = None


def forced_tokens(plan: RoundPlan | None) -> torch.Tensor | None:
    """``[k]`` ids a hybrid step forces as its block's first drafts (``None`` for any other step)."""
    return torch.tensor(plan.lookup_tokens) if plan is not None and plan.source == "hybrid" else None


def lookup_proposal(plan: RoundPlan, vocab_size: int, do_sample: bool) -> DraftBlock:
    """A lookup step's proposal as a block: ``tokens`` ``[ℓ]`` the plan's lookup tokens, ``logits`` ``[ℓ, V]``
    one-hot when sampling (``None`` when greedy), no confidences (no drafter pass)."""
    tokens = torch.tensor(plan.lookup_tokens[:plan.length], dtype=torch.long)
    return DraftBlock(tokens=tokens, logits=one_hot_logits(tokens, vocab_size) if do_sample else None,
                      confidences=None)
