"""Prompt-lookup drafts inside the DSpark round, chosen by the same expected throughput Θ (issue #14).

Each round, before anything is drafted, :class:`LookupDrafting` finds the longest n-gram of the text so far
(prompt + generated) that ends with the anchor token and occurred earlier, takes what followed it as a
lookup continuation, and plans one of four proposals by the expected throughput ``Θ(ℓ) = (1 + Σ_{j<=ℓ} a_j) ·
rate(1 + ℓ)`` (paper §3.2.2, :func:`dspark_hf.decoding.scheduler.expected_throughputs`), where ``rate(B)`` is the
target's SPS curve with the round's costs outside the verification added (:meth:`dspark_hf.SPSCurve.round_rates`:
bookkeeping every round, the drafter's pass only in rounds that draft):

* ``"lookup"``: the first ℓ continuation tokens (no drafter pass at all);
* ``"dspark"``: the DSpark block, its ℓ left to the call's verification mode;
* ``"hybrid"``: k continuation tokens forced as the block's first drafts, the drafter continuing from them
  (:meth:`dspark_hf.DSparkDrafter.draft` with ``forced_tokens``: the sequential and confidence heads take
  the lookup tokens as their previous tokens; the parallel backbone never sees draft tokens, so nothing
  else changes), ℓ = k + the planned DSpark part;
* ``"target"``: nothing drafted, the target verifies the anchor alone (a plain decoding step), when no draft is
  expected to repay its cost. Such rounds skip the drafter entirely (its context is caught up only when a round
  drafts again), so a stretch of them runs at the cost of plain decoding. The DSpark estimate they are judged by
  is refreshed by a probe: a round that would be ``"target"`` drafts a DSpark block and verifies at least its first
  draft (so the online correction hears from the drafter) once the estimate is older than the probe's wait
  (:meth:`RoundPlanner.probe_wait`): ``probe_interval`` rounds (:data:`REFRESH_ROUNDS` at first), or more where a
  probe, priced by the round costs the plan reads, would lose more than
  :data:`~dspark_hf.decoding.batch_costs.PROBE_LOSS_BOUND` (1 %) of the plain rounds it waits (as the concurrent
  engine spaces its re-measures, :class:`~dspark_hf.decoding.batch_costs.DraftGate`). Each probe doubles the interval
  (up to :data:`~dspark_hf.decoding.batch_costs.MAX_PROBE_INTERVAL`); a round that plans DSpark or a hybrid on its own
  merits resets it, so a prompt the drafter cannot follow loses at most ``PROBE_LOSS_BOUND`` of its plain rounds to
  probes (more only where a probe costs more than ``PROBE_LOSS_BOUND · MAX_PROBE_INTERVAL`` plain rounds).

Survival estimates (``a_j = Π_{i<=j} c_i``):

* a lookup draft: ``c_i`` = the posterior mean of an online count of lookup acceptance keyed by the effective
  match length ``n + i - 1`` (after ``i - 1`` accepted continuation tokens the match is that long), whose prior
  is the acceptance pooled over every length so far in the generation (first tokens and later ones pooled apart),
  itself starting from what the drafter's earlier calls measured (:mod:`dspark_hf.decoding.lookup_acceptance`):
  a length never seen yet starts from what this prompt's lookups have been worth, a new prompt from what earlier
  prompts' were, not from 1/2. Every round scores the continuation it looked up against the tokens the round produced, whatever
  was proposed: ``P(t_i = l_i) = p(l_i)`` is exactly the acceptance probability of a one-hot proposal (greedy:
  ``t_i = l_i`` is acceptance), so the estimate is the empirical acceptance frequency, calibrated by
  construction (what STS does for the drafter's c_k, paper §3.2.1), and it keeps learning in rounds that
  proposed DSpark;
* a DSpark draft at block position j: the calibrated confidence ``c'_j`` of the LAST DRAFTED block (as the
  ``"async"`` mode uses the previous block, paper §5.2), times the generation's online correction
  (:class:`~dspark_hf.decoding.calibration.OnlineCorrection`: what this prompt's verified drafts were worth
  against their calibrated confidences). Until a first block is drafted, the round proposes DSpark.

Lossless: the plan is a function of the accepted text and of earlier rounds only; no draft of the round can
change which proposal is made or how many tokens a lookup or hybrid round verifies (Appendix A: admitting a
draft must not depend on its own value). Lookup tokens are deterministic given the accepted text; under
sampling they are returned as one-hot proposal logits, so transformers' rejection step
(``_speculative_sampling``: accept ``l`` with probability ``p(l)``, else resample from ``p`` without ``l``)
stays exact. DSpark rounds keep their mode's own (non-anticipating) ℓ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .batch_costs import MAX_PROBE_INTERVAL, PROBE_LOSS_BOUND, priced_wait
from .calibration import OnlineCorrection
from .lookup_acceptance import MAX_NGRAM, LookupAcceptance, LookupPrior
from .scheduler import expected_throughputs
from .verification import POLICIES

__all__ = ["LookupDrafting", "LookupMatch", "RoundPlan", "RoundPlanner", "find_continuation",
           "lookup_enabled", "lookup_missing", "one_hot_logits", "plan_round"]

REFRESH_ROUNDS = 4  # a "target" round probes (drafts) once the last drafted block is at least this many rounds old
MARGIN = 0.05  # a proposal must beat the target alone by this share of Θ: the estimates behind Θ are noisy, and a
# plan that only breaks even when they are right loses when they are a little optimistic
SOURCES = ("dspark", "lookup", "hybrid", "target")


@dataclass(frozen=True)
class LookupMatch:
    """A lookup continuation: ``tokens`` followed an earlier occurrence of the last ``match_length`` tokens."""

    tokens: tuple[int, ...]
    match_length: int


def find_continuation(ids: torch.Tensor | Sequence[int], max_tokens: int, max_ngram: int = MAX_NGRAM
                      ) -> LookupMatch | None:
    """Longest earlier match of the text's suffix and the (up to) ``max_tokens`` tokens that followed it.

    The suffix n-gram ends with the last token of ``ids`` (the anchor); ``n`` runs down from ``max_ngram`` to 1
    in effect (the longest match wins). Among occurrences of that longest ``n``, the most recent one with a
    full ``max_tokens`` continuation is taken, else the earliest (the longest continuation). The continuation may
    overlap the suffix itself (a repeating pattern continues itself).

    Args:
        ids: ``(L,)`` token ids: prompt + generated text, ending with the anchor.
        max_tokens: most continuation tokens to return (``<= 0`` returns ``None``).
        max_ngram: longest suffix compared.

    Returns:
        :class:`LookupMatch` with 1..``max_tokens`` tokens and ``match_length`` in 1..``max_ngram``, or
        ``None`` when the anchor never occurred before (or ``max_ngram < 1``).
    """
    seq = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else list(ids)
    last = len(seq) - 1  # the anchor's position
    if last < 1 or max_tokens <= 0 or max_ngram < 1:
        return None
    # plain Python, not tensor ops: this runs every round, and a few hundred tokens scanned by list.index cost less
    # than the dozen small torch ops a vectorised match needs (issue #28: the planner's share of a plain step)
    anchor, depth = seq[last], min(max_ngram, last)
    best, ends, p = 0, [], -1  # ends: the positions whose match is `best` long, ascending
    while True:
        try:
            p = seq.index(anchor, p + 1, last)  # the next earlier occurrence of the anchor
        except ValueError:
            break
        n = 1
        while n < depth and n <= p and seq[p - n] == seq[last - n]:
            n += 1
        if n > best:
            best, ends = n, [p]
        elif n == best:
            ends.append(p)
    if best == 0:
        return None
    full = [e for e in ends if e + max_tokens <= last]
    p = full[-1] if full else ends[0]
    return LookupMatch(tuple(seq[p + 1: p + 1 + max_tokens]), best)


@dataclass(frozen=True)
class RoundPlan:
    """What one round proposes, decided before any drafting.

    Attributes:
        source: ``"dspark"``, ``"lookup"``, ``"hybrid"`` or ``"target"``.
        lookup_tokens: lookup continuation tokens the proposal starts with (``()`` for ``"dspark"``, ``"target"``).
        length: planned ℓ for ``"lookup"`` / ``"hybrid"`` / ``"target"`` (0); ``None`` for ``"dspark"`` (the mode
            decides).
        theta: the planned Θ (expected tokens per second of the chosen proposal).
        probe: a ``"dspark"`` round drafted only to refresh a stale estimate; it verifies at least one draft.
    """

    source: str
    lookup_tokens: tuple[int, ...] = ()
    length: int | None = None
    theta: float = 0.0
    probe: bool = False


def _best(conditionals: Sequence[float], sps: Sequence[float], shortest: int) -> tuple[int, float]:
    """``(ℓ, Θ(ℓ))`` maximising Θ over ``ℓ >= shortest`` (ties: the shorter)."""
    thetas = expected_throughputs(conditionals, sps)
    length = max(range(shortest, len(thetas)), key=thetas.__getitem__)
    return length, thetas[length]


def plan_round(lookup: Sequence[float], dspark: Sequence[float] | None, sps: Sequence[float], gamma: int,
               dspark_rates: Sequence[float] | None = None, margin: float = 0.0) -> tuple[str, int, int | None, float]:
    """The proposal with the highest expected throughput (a pure function of estimates made before drafting).

    Args:
        lookup: estimated conditional acceptance ``c_i`` of the lookup continuation tokens (``m`` values, may
            be empty).
        dspark: estimated conditional acceptance of DSpark drafts at block positions ``1..γ`` (``γ`` values),
            or ``None`` (no estimate yet: DSpark is proposed).
        sps: ``sps[B - 1]``: rounds per second of a round that does not run the drafter (lookup, target alone)
            verifying ``B`` tokens (:meth:`~dspark_hf.SPSCurve.round_rates`; the bare ``SPS(B)`` in the paper).
        gamma: the round's block size γ (a hybrid round verifies at most γ tokens).
        dspark_rates: the same for a round that runs the drafter (DSpark, hybrid); default ``sps`` (drafting free).
        margin: a drafting proposal is made only when its Θ exceeds the target alone's ``sps[0]`` by more than this
            share (``0``: any gain; :class:`LookupDrafting` plans with :data:`MARGIN`).

    Returns:
        ``(source, k, ℓ, Θ)``: ``k`` leading lookup tokens and the planned ℓ (``None`` for ``"dspark"``).
        ``"lookup"`` wins over DSpark on ties (it costs no drafter pass), ``"hybrid"`` needs a strictly higher Θ than
        what came before, and ``"target"`` (ℓ = 0, nothing drafted) is planned when the best proposal's Θ is below
        ``(1 + margin) · sps[0]``; with free drafting and no margin it never is (DSpark's ℓ = 0 is the same round).

    Raises:
        ValueError: estimates outside ``[0, 1]`` or an invalid ``sps`` (see :func:`expected_throughputs`).
    """
    top = len(sps) - 1  # the SPS table covers ℓ <= top
    if dspark is None or gamma < 1 or top < 1:
        return "dspark", 0, None, 0.0
    drafted = sps if dspark_rates is None else dspark_rates
    dspark = list(dspark)[:gamma]
    _, best = _best(dspark, drafted, 0)
    plan = ("dspark", 0, None, best)
    if lookup:
        length, theta = _best(lookup, sps, 1)
        if theta >= best:
            plan, best = ("lookup", length, length, theta), theta
    for k in range(1, min(len(lookup), len(dspark) - 1, top - 1) + 1):
        length, theta = _best([*lookup[:k], *dspark[k:]], drafted, k + 1)
        if theta > best:
            plan, best = ("hybrid", k, length, theta), theta
    if best < (1.0 + margin) * sps[0]:
        plan = ("target", 0, 0, sps[0])
    return plan


def one_hot_logits(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits of deterministic proposals: ``(k,)`` ids -> ``(k, V)`` rows of 0 at the id and ``-inf`` elsewhere
    (``softmax`` gives the one-hot proposal distribution of each lookup draft)."""
    return F.one_hot(tokens, vocab_size).float().log()


def lookup_missing(drafter, block_size: int) -> str | None:
    """What ``drafter`` lacks for prompt lookup at γ = ``block_size``, in words (``None``: nothing): the proposal
    choice compares Θ of lookup and DSpark drafts by the calibrated confidences of the last drafted block, so it needs
    the confidence head and a calibration covering γ. The one rule, read by :func:`lookup_enabled`, ``dspark generate
    --lookup`` and the bench's hybrid method."""
    if drafter.confidence is None:
        return "the drafter's confidence head to compare proposals by Θ"
    if drafter.calibration is None or len(drafter.calibration.temperatures) < block_size:
        return f"calibrated confidences for γ = {block_size} positions"
    return None


def lookup_enabled(setting, drafter, block_size: int, mode: str) -> bool:
    """Resolve the ``dspark_lookup`` generate setting for a drafter, γ and verification mode.

    The proposal choice compares Θ of lookup and DSpark drafts, and DSpark's survival estimate is the calibrated
    confidence of the last drafted block, so the drafter needs a confidence head and a calibration covering γ.

    Args:
        setting: ``None`` (the default): on with a scheduled ``mode`` (``scheduler``, ``async``: blocks already sized
            by Θ) and calibrated confidences for γ, off otherwise (``fixed`` and ``threshold`` keep the blocks they
            promise). ``True``: on, or an error; ``False``: off. Default on because the bench measured the hybrid
            faster than DSpark alone on every suite (issue #14).

    Raises:
        ValueError: ``setting`` is not ``None`` or a bool, or it is ``True`` and the drafter lacks calibrated
            confidences (the message names the fix).
    """
    if setting is not None and not isinstance(setting, bool):
        raise ValueError(f"dspark_lookup must be None (automatic), True or False, got {setting!r}")
    missing = lookup_missing(drafter, block_size)
    if setting is None:
        return mode in POLICIES and POLICIES[mode].needs_calibration and missing is None  # unknown: refused later
    if setting and missing:
        raise ValueError(f"dspark_lookup=True needs {missing}; run `dspark calibrate`, or pass dspark_lookup=False.")
    return setting


class RoundPlanner:
    """Whether one request's next round runs the drafter (``"dspark"``) or verifies the target's token alone
    (``"target"``), and, given lookup estimates, whether a lookup or hybrid proposal beats both
    (:func:`plan_round` with :data:`MARGIN`), decided before anything is drafted. DSpark is judged by the last drafted
    block's calibrated confidences times the online correction; a stale estimate is refreshed by a probe (module
    docstring). The state :class:`LookupDrafting` plans with for one ``generate`` call, and the concurrent engine for
    a request alone in flight (:mod:`dspark_hf.decoding.concurrent`, issue #24).

    Args:
        calibration: the drafter's :class:`~dspark_hf.SequentialTemperatureScaling`.
        correction: the :class:`~dspark_hf.decoding.calibration.OnlineCorrection` of DSpark's calibrated
            confidences (``None``: none; the caller folds verified rounds into it).
    """

    def __init__(self, calibration, correction: OnlineCorrection | None = None):
        self.calibration = calibration
        self.correction = correction
        self.block_estimate: list[float] | None = None  # calibrated c' of the last drafted block (uncorrected)
        self.block_age = 0  # rounds planned since that block was drafted
        self.probe_interval = REFRESH_ROUNDS  # the least rounds without a drafted block before a probe (probe_wait)

    def choose(self, rates: Sequence[float], draft_rates: Sequence[float], gamma: int, lookup: Sequence[float] = (),
               continuation: Sequence[int] = ()) -> RoundPlan:
        """The round's plan by :func:`plan_round` (``rates`` / ``draft_rates``: rounds per second verifying ``B``
        tokens without / with a drafter pass, index ``B - 1``; ``lookup``: the conditionals of the lookup
        ``continuation``'s tokens), a ``"target"`` round turned into a probe once the estimate is older than
        :meth:`probe_wait` rounds."""
        source, k, length, theta = plan_round(lookup, self.dspark_estimate(), rates, gamma, draft_rates, MARGIN)
        self.block_age += 1
        probe = False
        if source == "target" and self.block_age > self.probe_interval:  # cheap test first: the wait is >= it
            wait = self.probe_wait(rates[0], draft_rates[1])
            probe = self.block_age > wait
        if probe:  # the estimate is stale: draft to refresh it, and wait twice as long for the next probe
            source, length = "dspark", None
            self.probe_interval = min(2 * wait, MAX_PROBE_INTERVAL)
        elif source in ("dspark", "hybrid"):  # the drafter is worth its pass again
            self.probe_interval = REFRESH_ROUNDS
        return RoundPlan(source, tuple(continuation[:k]), length, theta, probe)

    def probe_wait(self, rate: float, probe_rate: float) -> int:
        """Rounds without a drafted block before a ``"target"`` round probes: :attr:`probe_interval`, or more where a
        probe would lose more than :data:`~dspark_hf.decoding.batch_costs.PROBE_LOSS_BOUND` of the plain rounds it waits
        (:func:`~dspark_hf.decoding.batch_costs.priced_wait`, the concurrent engine's re-measure rule), at most
        :data:`~dspark_hf.decoding.batch_costs.MAX_PROBE_INTERVAL`.

        A probe verifies the anchor and (at least) one draft after a drafter pass: it emits ``1 + c_1`` tokens in
        expectation (``c_1``: the current DSpark estimate's first conditional, 0 before any block) in one round at
        ``probe_rate``, where plain rounds at ``rate`` emit one each, so it loses ``rate / probe_rate - (1 + c_1)``
        plain rounds (at least 0). A function of earlier rounds only (lossless).

        Args:
            rate: rounds per second of a round verifying the target's token alone (``B = 1``, no drafter pass).
            probe_rate: rounds per second of a round that runs the drafter and verifies ``B = 2`` tokens.
        """
        estimate = self.dspark_estimate()
        loss = max(0.0, rate / probe_rate - 1.0 - (estimate[0] if estimate else 0.0))  # plain rounds
        return priced_wait(self.probe_interval, loss, MAX_PROBE_INTERVAL, PROBE_LOSS_BOUND)

    def dspark_estimate(self) -> list[float] | None:
        """The DSpark conditionals the next plan reads: the last block's calibrated ``c'`` with the current online
        correction applied (``None`` before the first block)."""
        if self.block_estimate is None or self.correction is None:
            return self.block_estimate
        return self.correction.apply(self.block_estimate)

    def observe_block(self, confidences: torch.Tensor) -> None:
        """Keep the calibrated confidences ``(γ,)`` of the block just drafted as the next rounds' DSpark estimate."""
        self.block_estimate = self.calibration.apply(confidences.float()).tolist()
        self.block_age = 0


class LookupDrafting(RoundPlanner):
    """Per-``generate``-call state of the hybrid: the :class:`RoundPlanner`'s, the lookup acceptance estimate and the
    lookup match of the round in flight.

    Args:
        calibration / correction: as :class:`RoundPlanner`.
        curve: the target's :class:`~dspark_hf.SPSCurve` (read each round at the round's context, with its learnt
            round costs: :meth:`~dspark_hf.SPSCurve.round_rates`).
        max_tokens: most lookup tokens per round (also capped by ``curve.max_tokens - 1`` and the token budget).
        prior: the :class:`~dspark_hf.decoding.lookup_acceptance.LookupPrior` of earlier calls the acceptance
            estimate starts from and feeds (``None``: Beta(1, 1), nothing shared).
    """

    def __init__(self, calibration, curve, max_tokens: int, correction: OnlineCorrection | None = None,
                 prior: LookupPrior | None = None):
        super().__init__(calibration, correction)
        self.curve = curve
        self.max_tokens = min(max_tokens, curve.max_tokens - 1)
        self.acceptance = LookupAcceptance(prior=prior)
        self._match: LookupMatch | None = None

    def plan(self, input_ids: torch.Tensor, gamma: int, room: int) -> RoundPlan:
        """Plan the round from the accepted text ``input_ids`` ``(1, L)`` (anchor last), γ and the number of draft
        tokens the budget leaves (``room``); remembers the lookup match for :meth:`update`."""
        self._match = find_continuation(input_ids[0], min(self.max_tokens, room))
        lookup = self.acceptance.conditionals(self._match) if self._match is not None else []
        context = input_ids.shape[1] - 1  # tokens in the target's cache before this round's verification
        sizes = max(gamma, len(lookup)) + 1  # the most a plan can verify (a hybrid's k lookup tokens count in γ)
        return self.choose(self.curve.round_rates(context, False, sizes), self.curve.round_rates(context, True, sizes),
                           gamma, lookup, self._match.tokens if self._match is not None else ())

    def update(self, input_ids: torch.Tensor, num_matches: int) -> None:
        """After verification: score the round's lookup continuation against its ``num_matches + 1`` produced
        tokens (the end of ``input_ids`` ``(1, L')``)."""
        if self._match is not None:
            produced = input_ids[0, input_ids.shape[1] - int(num_matches) - 1:].tolist()
            self.acceptance.update(self._match, produced)
        self._match = None
