"""`target.generate(..., assistant_model=drafter)` with DSpark drafting and confidence scheduling.

Routing ``generate`` here is :mod:`dspark_hf.decoding.routing`; the verification modes are
:mod:`dspark_hf.decoding.verification`.

Per-call settings (keyword arguments of ``generate``):

* ``dspark_block_size``: block size γ (default ``drafter.config.block_size``);
* ``dspark_verification``: ``"scheduler"`` (paper Algorithm 1; the default of a new ``DSparkConfig``), ``"async"`` (paper §5.2: the
  global search without early stop, on confidences that no draft of the block depends on), ``"fixed"`` (verify all γ, the paper's
  Table 1 protocol) or ``"threshold"`` (verify while c_k >= threshold);
* ``dspark_threshold``: the threshold of ``"threshold"`` mode (default 0.4);
* ``dspark_lookup``: also look up n-gram continuations in the prompt and the generated text and propose, each
  round, a lookup continuation, the DSpark block or a lookup prefix continued by DSpark, by expected throughput
  (:mod:`dspark_hf.decoding.lookup`). Default ``None``: on in the scheduled modes when the drafter is calibrated
  for γ, off otherwise; ``True`` insists (or raises), ``False`` turns it off.

The defaults come from the drafter's config (``block_size``, ``verification``, ``confidence_threshold``).
transformers' ``num_assistant_tokens`` is honoured as γ (the same meaning); the other assistant options
(``num_assistant_tokens_schedule`` other than ``"constant"``, ``assistant_confidence_threshold``,
``prompt_lookup_num_tokens``, ``assistant_early_exit``, ``assistant_ensemble_weight``, ``use_mtp``) raise
before any compute, naming the DSpark equivalent; ``dspark_*`` settings without a DSpark drafter raise too.
Stopping criteria other than max length / EOS / max time (stop strings, custom criteria) are applied after
every token of a verified round and the output is cut at the first stop, as plain ``generate`` stops.
"""

from __future__ import annotations

import numbers
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..modeling.drafting import warm_up
from ..modeling.limits import MAX_BLOCK_SIZE, VERIFICATION_MODES
from ..modeling.modeling_dspark import DSparkDrafter
from ..runtime.capture import LayerCapture
from ..runtime.kernels import prepack_like
from ..runtime.profiling import ensure_sps_curve
from .calibration import CorrectedCalibration, OnlineCorrection
from .lookup import LookupDrafting, RoundPlan, lookup_enabled, one_hot_logits
from .lookup_acceptance import lookup_prior
from .settings import call_block_size
from .stats import GenerationStats, RoundStats, publish_stats
from .verification import POLICIES, unmet_need


def _setting(generation_config, name, default):
    value = getattr(generation_config, name, None)
    return default if value is None else value


@dataclass(frozen=True)
class CallSettings:
    """One ``generate`` call's DSpark settings, resolved and checked (:func:`call_settings`).

    Attributes:
        block_size: γ, drafts per round.
        mode: the verification mode (:data:`~dspark_hf.modeling.configuration_dspark.VERIFICATION_MODES`).
        threshold: the ``threshold`` mode's confidence threshold, in ``[0, 1]``.
        lookup: whether prompt lookup plans each round (:func:`~dspark_hf.decoding.lookup.lookup_enabled`).
    """

    block_size: int
    mode: str
    threshold: float
    lookup: bool

    @property
    def needs_sps(self) -> bool:
        """Whether the call reads the target's SPS curve (the scheduled modes and prompt lookup weigh rounds by it)."""
        return POLICIES[self.mode].needs_calibration or self.lookup


def call_settings(drafter: DSparkDrafter, generation_config) -> CallSettings:
    """The DSpark settings of one call: ``dspark_*`` keywords of ``generate``, else the drafter's config.

    Warns:
        UserWarning: ``dspark_threshold`` given to a mode other than ``threshold`` (it is ignored).

    Raises:
        ValueError: an unknown verification mode, a threshold outside ``[0, 1]``, a non-``fixed`` mode without a
            confidence head, ``scheduler``/``async`` mode without a calibration covering γ; as
            :func:`~dspark_hf.decoding.settings.call_block_size` and :func:`~dspark_hf.decoding.lookup.lookup_enabled`.
    """
    cfg = drafter.config
    block_size = call_block_size(generation_config, cfg.block_size)
    mode = _setting(generation_config, "dspark_verification", cfg.verification)
    threshold = _setting(generation_config, "dspark_threshold", cfg.confidence_threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):  # refused as dspark_block_size='4' is
        raise ValueError(f"dspark_threshold must be a number in [0, 1], got {threshold!r}")
    threshold = float(threshold)
    _check_mode(drafter, mode, threshold, block_size)
    if mode != "threshold" and getattr(generation_config, "dspark_threshold", None) is not None:
        warnings.warn(f"dspark_threshold={threshold} is read by dspark_verification='threshold' only; this call "
                      f"verifies in the {mode!r} mode and ignores it.", UserWarning, stacklevel=2)
    lookup = lookup_enabled(_setting(generation_config, "dspark_lookup", None), drafter, block_size, mode)
    return CallSettings(block_size=block_size, mode=mode, threshold=threshold, lookup=lookup)


def _check_mode(drafter: DSparkDrafter, mode: str, threshold: float, block_size: int) -> None:
    """Raise the error of :func:`call_settings` when ``drafter`` cannot run ``mode`` at γ = ``block_size``."""
    need = unmet_need(drafter, mode, block_size)
    if need == "mode":
        raise ValueError(f"dspark_verification must be one of {VERIFICATION_MODES}, got {mode!r}")
    if mode == "threshold" and not 0.0 <= threshold <= 1.0:
        raise ValueError(f"dspark_threshold must be a probability in [0, 1], got {threshold}")
    if need == "confidence":
        raise ValueError(
            f"Verification mode {mode!r} needs a confidence head, and this drafter has none; "
            "pass dspark_verification='fixed'."
        )
    if need == "calibration":
        raise ValueError(
            f"The {mode!r} mode needs calibrated confidences and this drafter has no calibration.json: run "
            "`dspark calibrate`, attach one with `drafter.calibration = SequentialTemperatureScaling(...)`, "
            "or pass dspark_verification='fixed'."
        )
    if need == "calibration_length":
        raise ValueError(
            f"The calibration covers {len(drafter.calibration.temperatures)} positions but "
            f"dspark_block_size is {block_size}: lower dspark_block_size or rerun `dspark calibrate` "
            "with that block size."
        )


def prepare_call(target, drafter: DSparkDrafter, generation_config) -> CallSettings:
    """Bind ``drafter`` to ``target``, check the call's settings and, when they read it, give the drafter the
    target's SPS curve: the point where a one-row ``generate(assistant_model=drafter)`` resolves it (the routing
    runs this before transformers' assisted loop, so the candidate generator's constructor does no measuring).

    The curve is the drafter's own when it covers γ + 1 verified tokens (``drafter.set_sps_curve``), else the
    stored profile of this target on this machine, else one measured now (about 25 s on a CPU, then stored:
    :func:`~dspark_hf.runtime.profiling.ensure_sps_curve`). To choose when that happens (e.g. at server start),
    run ``dspark profile`` or ``drafter.set_sps_curve(dspark_hf.load_or_profile_sps(target))`` beforehand.

    Raises:
        ValueError / TypeError: as :meth:`DSparkDrafter.bind` and :func:`call_settings`.
    """
    drafter.bind(target)
    settings = call_settings(drafter, generation_config)
    if settings.needs_sps:
        longest = max(drafter.config.block_size, settings.block_size) + 1
        ensure_sps_curve(target, drafter, settings.block_size + 1, longest)
    return settings


_FLOOR_ROUNDS: ContextVar[bool] = ContextVar("dspark_floor_rounds", default=False)
_TARGET_ROUND = RoundPlan("target", (), 0)  # nothing drafted: the target verifies the anchor alone


@contextmanager
def floor_rounds() -> Iterator[None]:
    """Inside this block, every round of a one-row DSpark ``generate`` verifies only the target's own token: each
    round is planned as usual (prompt lookup, the planner's estimates) and then proposes nothing, so the call runs
    the loop's floor, the round a plan of ``"target"`` makes (issue #28), on every token, and its output is plain
    ``generate``'s (greedy or sampled). For measuring what that round costs against a plain decoding step
    (``dspark bench``'s floor pass, :mod:`dspark_hf.bench.runner`); not a decoding mode. Read when the call's
    candidate generator is built; context-local (each thread and asyncio task sees its own)."""
    token = _FLOOR_ROUNDS.set(True)
    try:
        yield
    finally:
        _FLOOR_ROUNDS.reset(token)


@dataclass
class _Proposal:
    """What a round proposes for verification (:meth:`DSparkCandidateGenerator._propose`)."""

    drafts: torch.Tensor  # [γ'] the proposed ids (drafts or lookup tokens)
    confidences: torch.Tensor | None  # [γ'] the drafter's confidences, None without a drafter pass
    logits: torch.Tensor | None  # [γ', V] the proposal's processed logits when sampling
    scheduled: int  # ℓ, how many of them go to verification
    context_ms: float = 0.0  # appending pending target features to the drafter's context
    context_tokens: int = 0


class DSparkCandidateGenerator(CandidateGenerator):
    """Drafts one DSpark block per round and returns its scheduled prefix (paper Fig. 1).

    Each round it appends the target's hidden states of the newly accepted positions (recorded by the call's
    :class:`~dspark_hf.runtime.capture.LayerCapture`) to the drafter's context cache, drafts γ tokens from the
    anchor (the last token of ``input_ids``), picks a prefix length ℓ by the verification mode and returns
    ``input_ids + drafts[:ℓ]``. With sampling the drafts
    are drawn from the returned (processed) logits, so transformers' speculative sampling is exact;
    with greedy decoding no logits are returned and the target's argmax decides. With ``dspark_lookup=True`` a
    :class:`~dspark_hf.decoding.lookup.LookupDrafting` plans each round first: a prompt-lookup continuation (no drafter
    pass, one-hot proposal logits), the DSpark block, or lookup tokens forced as the block's first drafts.

    The call's statistics are a fresh :class:`~dspark_hf.decoding.stats.GenerationStats` (``self.stats``), published
    as the calling thread's ``drafter.last_stats`` (:func:`~dspark_hf.decoding.stats.publish_stats`).

    Raises:
        ValueError: batch size > 1 (``generate`` sends batches to :mod:`dspark_hf.decoding.concurrent`), and as
            :func:`call_settings`.
        RuntimeError: the call needs an SPS curve and the drafter has none covering γ (:func:`prepare_call` gives
            it one; ``generate`` runs it); no capture of the target's layers is active (``generate`` opens one,
            :func:`~dspark_hf.decoding.routing._assisted_decoding`).
    """

    requires_model_outputs = True  # for is_first_iteration; the features themselves come from the capture

    def __init__(self, target, drafter: DSparkDrafter, generation_config, logits_processor, input_ids):
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"DSparkCandidateGenerator drafts for one row (got {input_ids.shape[0]}); batches run in "
                "dspark_hf.decoding.concurrent (target.generate routes them there)."
            )
        self.drafter = drafter.bind(target)
        prepack_like(self.drafter, target)  # the drafter runs its target's CPU kernels (no-op when done)
        settings = call_settings(drafter, generation_config)
        warm_up(self.drafter, settings.block_size)  # once per drafter and γ: no round pays the kernels' set-up
        self.block_size, self.mode, self.threshold = settings.block_size, settings.mode, settings.threshold
        self.policy = POLICIES[self.mode]()
        if settings.needs_sps and (drafter.sps_curve is None or drafter.sps_curve.max_tokens <= self.block_size):
            raise RuntimeError("This call reads the target's SPS curve and the drafter has none covering "
                               f"γ = {self.block_size}: run dspark_hf.decoding.candidate_generator.prepare_call first.")
        self.sps = drafter.sps_curve
        # the round planner learns how far this prompt's drafts beat or miss their calibrated confidences
        self.correction = OnlineCorrection() if settings.lookup else None
        self.lookup = (LookupDrafting(drafter.calibration, self.sps, MAX_BLOCK_SIZE, self.correction,
                                      lookup_prior(drafter, generation_config.do_sample)) if settings.lookup else None)
        # ℓ is planned on the estimates Θ plans with: the calibrated confidences, corrected online when they are
        self.calibration = (CorrectedCalibration(drafter.calibration, self.correction) if self.correction is not None
                            else drafter.calibration)
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        # the target features come from the call's LayerCapture (routing opens it), not output_hidden_states
        self.capture = LayerCapture.current(target)
        self.model_kwargs_overrides = {}
        self.context = drafter.new_context()
        self._pending: list[torch.Tensor] = []  # target features not yet in the context (added before a draft)
        self._known = 0  # positions in the context or pending
        self.floor = _FLOOR_ROUNDS.get()  # every round verifies the target's token alone (:func:`floor_rounds`)
        self.stats = GenerationStats(verification=self.mode, lookup_prior=(
            self.lookup.acceptance.prior_means[True], self.lookup.acceptance.prior_means[False]) if self.lookup else None)
        publish_stats(drafter, self.stats)
        self._verify_start = None
        self._verify_context = 0  # tokens in the target's cache before the round's verification
        self._round_start = None  # when the last round's get_candidates began (its costs are learnt at the next)
        self._pass_seconds = None  # the last round's drafter pass (None: it did not draft)
        self._prompt_seconds = 0.0  # the last round's extension of the drafter's context over the prompt

    @property
    def num_drafting_tokens(self) -> int:
        """Most tokens a round proposes after the anchor: γ, or a longer prompt-lookup continuation. transformers'
        assisted loop (5.25 on) records this many recurrent states so that a cache of linear-attention layers can be
        cropped back over a rejected proposal (``cache.activate_past_recording``); attention caches ignore it."""
        return max(self.block_size, self.lookup.max_tokens if self.lookup is not None else 0)

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs):
        """See :class:`~transformers.generation.CandidateGenerator`; the first call lets the target prefill.

        Returns:
            ``(candidates, logits)``: ``[1, L + ℓ]`` ids (``input_ids`` then ℓ proposed tokens) and, when
            sampling, ``[1, ℓ, V]`` their processed logits (``None`` when greedy or ``ℓ = 0``).
        """
        if is_first_iteration:
            return input_ids, None
        # 1. bookkeeping: the last round's costs, the target features it accepted
        entry = time.perf_counter()
        self._learn_round_costs(entry)
        self._collect_features(input_ids)
        gamma = min(self.block_size, self.max_length - input_ids.shape[1] - 1)
        self._verify_context = input_ids.shape[1] - 1  # the scheduler reads the SPS row of this context
        start = time.perf_counter()
        bookkeeping_ms = 1e3 * (start - entry)
        if gamma <= 0:  # one token left: the target verifies the anchor alone, a round without drafts
            self._start_verification(RoundStats(drafted=0, scheduled=0, bookkeeping_ms=bookkeeping_ms))
            return input_ids, None
        # 2. plan (prompt lookup, before any drafting), 3. propose, 4. record the round
        plan = self.lookup.plan(input_ids, gamma, self.max_length - input_ids.shape[1] - 1) if self.lookup is not None else None
        if self.floor:  # planned, then overruled (floor_rounds)
            plan = _TARGET_ROUND
        plan_ms = 1e3 * (time.perf_counter() - start)
        proposal = self._propose(input_ids, gamma, plan)
        length = proposal.scheduled  # never looks at a draft's own value (Appendix A); stop strings act after verification
        self._start_verification(RoundStats(
            drafted=proposal.drafts.numel(), scheduled=length, draft_tokens=proposal.drafts.tolist(),
            confidences=proposal.confidences.tolist() if proposal.confidences is not None else [],
            draft_ms=1e3 * (time.perf_counter() - start), lookup=len(plan.lookup_tokens) if plan is not None else 0,
            plan_ms=plan_ms, context_ms=proposal.context_ms, context_tokens=proposal.context_tokens,
            bookkeeping_ms=bookkeeping_ms,
        ))
        if length == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, proposal.drafts[:length][None].to(input_ids.device)], dim=-1)
        return candidates, (proposal.logits[None, :length] if self.do_sample else None)

    def _propose(self, input_ids, gamma: int, plan) -> _Proposal:
        """The round's proposal: the plan's lookup tokens (no drafter pass, one-hot logits), or a drafter block of
        ``gamma`` (its first drafts forced to the plan's tokens in a ``hybrid`` round) and its scheduled length."""
        if plan is not None and plan.source in ("lookup", "target"):  # no drafter pass
            drafts = torch.tensor(plan.lookup_tokens, dtype=torch.long)
            logits = one_hot_logits(drafts, self.drafter.config.vocab_size) if self.do_sample else None
            return _Proposal(drafts, None, logits, plan.length)
        forced = torch.tensor(plan.lookup_tokens) if plan is not None and plan.source == "hybrid" else None
        opening = self.context.length == 0  # the call's first drafted round: its catch-up is the whole prompt
        pass_start = time.perf_counter()
        context_tokens = self._catch_up_context()
        context_ms = 1e3 * (time.perf_counter() - pass_start)
        block = self.drafter.draft(
            self.context, int(input_ids[0, -1]), gamma, self.do_sample, self.logits_processor, input_ids,
            forced_tokens=forced,
        )
        self._prompt_seconds = context_ms / 1e3 if opening else 0.0
        self._pass_seconds = time.perf_counter() - pass_start - self._prompt_seconds
        if self.lookup is not None:
            self.lookup.observe_block(block.confidences)
        scheduled = plan.length if forced is not None else self._prefix_length(block, gamma)
        if plan is not None and plan.probe:  # a probe verifies a draft, so the correction hears from the drafter
            scheduled = max(scheduled, 1)
        return _Proposal(block.tokens, block.confidences, block.logits, scheduled, context_ms, context_tokens)

    def _learn_round_costs(self, now: float):
        """At the start of a round (``now``, ``time.perf_counter()`` seconds): the previous round's wall-clock time
        (recorded as its ``round_ms``) minus its verification and drafter pass (the context catch-up of the rounds
        since the last draft included) is its overhead; both refine the curve's round costs
        (:meth:`~dspark_hf.SPSCurve.observe_round`) when the curve learns online, so Θ weighs a drafter pass against
        rounds that skip it.

        The call's first drafted round also extends the drafter's context over the whole prompt: a cost of the call
        (~1 % of the target's prefill), paid once whichever rounds follow, so it is learnt as neither (the concurrent
        engine leaves its catch-ups out of the pass too). Learnt as part of the pass, it was the first observation of a
        fresh curve and every later call added one more: on a 2-core AVX2 EPYC at 1 thread, idle, the learnt pass read
        38 ms after three calls and 20-24 ms after 7-37, where it reads 15-18 ms without the extension."""
        last = self.stats.rounds[-1] if self.stats.rounds else None
        if last is not None and self._round_start is not None:
            last.round_ms = 1e3 * (now - self._round_start)
        if self.policy.needs_calibration and self.sps.online and self._round_start is not None and last is not None:
            draft = (self._pass_seconds or 0.0) + self._prompt_seconds
            overhead = max(now - self._round_start - last.verify_ms / 1e3 - draft, 0.0)
            self.sps.observe_round(overhead, self._pass_seconds)
        self._round_start, self._pass_seconds, self._prompt_seconds = now, None, 0.0

    def _start_verification(self, round_stats: RoundStats):
        """Record the round about to be verified and start its verify timer."""
        self.stats.rounds.append(round_stats)
        self._verify_start = time.perf_counter()

    def _collect_features(self, input_ids):
        """Keep the target features ``[1, n_new, m·d]`` of the newly accepted positions (up to ``L-2``) for the
        drafter's context; they are encoded into it only when a round drafts (:meth:`_catch_up_context`), so rounds
        that do not run the drafter (lookup, the target alone) skip the context projection."""
        n_new = input_ids.shape[1] - 1 - self._known
        self._pending.append(self.capture.features(n_new))
        self._known += n_new

    def _catch_up_context(self) -> int:
        """Append every pending feature to the drafter's context cache, in one pass (paper Fig. 1: the context
        holds positions ``0 .. L-2``, all accepted); returns the number of positions appended."""
        if not self._pending:
            return 0
        features = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending, dim=1)
        self.drafter.extend_context(self.context, features.to(self.drafter.context_proj.weight.device))
        self._pending = []
        return features.shape[1]

    def _prefix_length(self, block, gamma: int) -> int:
        """ℓ in 0..γ by the call's verification policy (:mod:`dspark_hf.decoding.verification`)."""
        sps = self.sps.round_rates(self._verify_context, True, gamma + 1) if self.policy.needs_calibration else None
        return self.policy.prefix_length(block.confidences, self.calibration, sps, gamma, self.threshold)

    def _observe_verified_drafts(self, last: RoundStats):
        """Fold the verified DSpark drafts of the round just verified into the online correction: block positions
        ``k+1..ℓ`` after ``k`` forced lookup tokens, heard from only when those ``k`` were all accepted."""
        if self.correction is None or not last.confidences:
            return
        calibrated = self.drafter.calibration.apply(torch.tensor(last.confidences)).tolist()
        self.correction.observe_round(calibrated, last.lookup, last.scheduled, last.accepted)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        """Record the number of accepted drafts and the verify time of the round just verified; in the
        scheduled modes the time also refines the SPS curve online (:meth:`~dspark_hf.SPSCurve.observe`)."""
        entry = time.perf_counter()
        if self.lookup is not None:  # score the round's lookup continuation (dspark_hf.decoding.lookup)
            self.lookup.update(input_ids, num_matches)
        if self._verify_start is not None and self.stats.rounds:
            last = self.stats.rounds[-1]
            last.accepted = int(num_matches)
            last.verify_ms = 1e3 * (entry - self._verify_start)
            self._verify_start = None
            self._observe_verified_drafts(last)
            if self.policy.needs_calibration and self.sps.online:  # B = ℓ + 1 tokens verified at this context
                self.sps.observe(last.scheduled + 1, self._verify_context, last.verify_ms / 1e3)
            last.bookkeeping_ms += 1e3 * (time.perf_counter() - entry)
