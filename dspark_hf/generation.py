"""`target.generate(..., assistant_model=drafter)` with DSpark drafting and confidence scheduling.

Routing: importing ``dspark_hf`` wraps ``GenerationMixin._get_candidate_generator`` and
``_validate_generation_mode`` so that an assistant that is a :class:`DSparkDrafter` gets
:class:`DSparkCandidateGenerator`; every other assistant keeps transformers' own behaviour untouched.

Per-call settings (keyword arguments of ``generate``):

* ``dspark_block_size``: block size γ (default ``drafter.config.block_size``);
* ``dspark_verification``: ``"scheduler"`` (paper Algorithm 1; the default of a new ``DSparkConfig``), ``"async"`` (paper §5.2: the
  global search without early stop, on confidences that no draft of the block depends on), ``"fixed"`` (verify all γ, the paper's
  Table 1 protocol) or ``"threshold"`` (verify while c_k >= threshold);
* ``dspark_threshold``: the threshold of ``"threshold"`` mode (default 0.4);
* ``dspark_lookup``: ``True`` to also look up n-gram continuations in the prompt and the generated text and
  propose, each round, a lookup continuation, the DSpark block or a lookup prefix continued by DSpark, by
  expected throughput (:mod:`dspark_hf.lookup`; default ``False``).

The defaults come from the drafter's config (``block_size``, ``verification``, ``confidence_threshold``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerationMixin, GenerationMode

from .kernels import is_prepacked, prepack_linears
from .lookup import LookupDrafting, lookup_enabled, one_hot_logits
from .metrics import tau
from .model import DSparkDrafter
from .profiling import load_or_profile_sps
from .scheduler import schedule_global, schedule_prefix, threshold_prefix

from .config import MAX_BLOCK_SIZE, SCHEDULED_MODES, VERIFICATION_MODES


@dataclass
class RoundStats:
    """One speculative round: drafted γ, scheduled ℓ, accepted n (drafts, bonus excluded), timings in ms.

    ``draft_tokens`` holds all γ drafted ids: ``[:accepted]`` were accepted, ``[accepted:scheduled]``
    rejected by the target, ``[scheduled:]`` pruned by the scheduler before verification. With
    ``dspark_lookup`` the first ``lookup`` of them are prompt-lookup tokens (all of them in a lookup round,
    which drafts nothing and has no confidences).
    """

    drafted: int
    scheduled: int
    accepted: int = 0
    draft_tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    lookup: int = 0


@dataclass
class GenerationStats:
    """Per-round statistics of the last ``generate`` call (``drafter.last_stats``)."""

    rounds: list[RoundStats] = field(default_factory=list)
    verification: str = "scheduler"

    @property
    def tau(self) -> float:
        """Mean accepted length per round τ, INCLUDING the bonus token (:func:`dspark_hf.metrics.tau`; 0 without rounds)."""
        return tau([r.accepted for r in self.rounds]) or 0.0

    def full_rounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Rounds that verified their whole block (γ = the call's block size), for calibration.

        The last round is dropped (EOS or the token budget may have cut its acceptance short).
        Returns ``(confidences [N, γ], accepted [N])``.
        """
        gamma = max((r.drafted for r in self.rounds), default=0)
        keep = [r for r in self.rounds[:-1] if r.drafted == r.scheduled == gamma and r.confidences and not r.lookup]
        if not keep:
            return torch.zeros(0, gamma), torch.zeros(0, dtype=torch.long)
        return torch.tensor([r.confidences for r in keep]), torch.tensor([r.accepted for r in keep])

    def token_sources(self) -> dict[str, int]:
        """Where the tokens of the recorded rounds came from: accepted ``lookup`` drafts, accepted ``dspark``
        drafts, and the ``target``'s own token of each round (bonus or correction). The prefill's first token and
        a last step with no room to draft are not rounds."""
        lookup = sum(min(r.accepted, r.lookup) for r in self.rounds)
        accepted = sum(r.accepted for r in self.rounds)
        return dict(lookup=lookup, dspark=accepted - lookup, target=len(self.rounds))

    def as_dict(self) -> dict:
        return dict(
            verification=self.verification,
            rounds=len(self.rounds),
            tau=self.tau,
            sources=self.token_sources(),
            draft_ms=sum(r.draft_ms for r in self.rounds),
            verify_ms=sum(r.verify_ms for r in self.rounds),
            per_round=[r.__dict__ for r in self.rounds],
        )


def _setting(generation_config, name, default):
    value = getattr(generation_config, name, None)
    return default if value is None else value


class DSparkCandidateGenerator(CandidateGenerator):
    """Drafts one DSpark block per round and returns its scheduled prefix (paper Fig. 1).

    Each round it appends the target's hidden states of the newly accepted positions to the drafter's
    context cache, drafts γ tokens from the anchor (the last token of ``input_ids``), picks a prefix
    length ℓ by the verification mode and returns ``input_ids + drafts[:ℓ]``. With sampling the drafts
    are drawn from the returned (processed) logits, so transformers' speculative sampling is exact;
    with greedy decoding no logits are returned and the target's argmax decides. With ``dspark_lookup=True`` a
    :class:`~dspark_hf.lookup.LookupDrafting` plans each round first: a prompt-lookup continuation (no drafter
    pass, one-hot proposal logits), the DSpark block, or lookup tokens forced as the block's first drafts.

    Raises:
        ValueError: batch size > 1, an unknown verification mode, a non-``fixed`` mode without a
            confidence head, or ``scheduler``/``async`` mode without a calibration covering γ.
    """

    requires_model_outputs = True

    def __init__(self, target, drafter: DSparkDrafter, generation_config, logits_processor, input_ids, tokenizer=None):
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"DSpark speculative decoding supports batch size 1 in `generate` (got {input_ids.shape[0]}); "
                "call generate once per prompt."
            )
        self.drafter = drafter.bind(target)
        if is_prepacked(target):  # the drafter runs the same CPU kernels as its target (no-op when done)
            prepack_linears(self.drafter)
        cfg = drafter.config
        self.block_size = int(_setting(generation_config, "dspark_block_size", cfg.block_size))
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"dspark_block_size (γ) must be in 1..{MAX_BLOCK_SIZE}, got {self.block_size}")
        self.mode = _setting(generation_config, "dspark_verification", cfg.verification)
        self.threshold = float(_setting(generation_config, "dspark_threshold", cfg.confidence_threshold))
        self._check_mode()
        use_lookup = lookup_enabled(_setting(generation_config, "dspark_lookup", False), drafter, self.block_size)
        stale = drafter.sps_curve is None or drafter.sps_curve.max_tokens <= self.block_size
        if (self.mode in SCHEDULED_MODES or use_lookup) and stale:
            drafter.set_sps_curve(load_or_profile_sps(target, max_tokens=max(cfg.block_size, self.block_size) + 1))
        self.sps = drafter.sps_curve
        self.lookup = LookupDrafting(drafter.calibration, self.sps.steps_per_s, MAX_BLOCK_SIZE) if use_lookup else None
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.max_length = generation_config.max_length
        self.stop_strings = (
            StopStringCriteria(tokenizer, generation_config.stop_strings) if generation_config.stop_strings else None
        )
        self.model_kwargs_overrides = {"output_hidden_states": [i + 1 for i in cfg.target_layer_ids]}
        self.context = drafter.new_context()
        self.stats = GenerationStats(verification=self.mode)
        drafter.last_stats = self.stats
        self._verify_start = None
        self._verify_context = 0  # tokens in the target's cache before the round's verification
        self._previous = None  # "async": calibrated confidences of the previous block

    def _check_mode(self):
        if self.mode not in VERIFICATION_MODES:
            raise ValueError(f"dspark_verification must be one of {VERIFICATION_MODES}, got {self.mode!r}")
        if self.mode == "threshold" and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"dspark_threshold must be a probability in [0, 1], got {self.threshold}")
        if self.mode != "fixed" and self.drafter.confidence is None:
            raise ValueError(
                f"Verification mode {self.mode!r} needs a confidence head, and this drafter has none; "
                "pass dspark_verification='fixed'."
            )
        if self.mode in SCHEDULED_MODES and self.drafter.calibration is None:
            raise ValueError(
                f"The {self.mode!r} mode needs calibrated confidences and this drafter has no calibration.json: run "
                "`dspark calibrate`, attach one with `drafter.calibration = SequentialTemperatureScaling(...)`, "
                "or pass dspark_verification='fixed'."
            )
        if self.mode in SCHEDULED_MODES and len(self.drafter.calibration.temperatures) < self.block_size:
            raise ValueError(
                f"The calibration covers {len(self.drafter.calibration.temperatures)} positions but "
                f"dspark_block_size is {self.block_size}: lower dspark_block_size or rerun `dspark calibrate` "
                "with that block size."
            )

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs):
        """See :class:`~transformers.generation.CandidateGenerator`; the first call lets the target prefill."""
        if is_first_iteration:
            return input_ids, None
        self._extend_context(input_ids, model_outputs)
        gamma = min(self.block_size, self.max_length - input_ids.shape[1] - 1)
        if gamma <= 0:
            return input_ids, None
        start = time.perf_counter()
        self._verify_context = input_ids.shape[1] - 1  # the scheduler reads the SPS row of this context
        room = self.max_length - input_ids.shape[1] - 1
        plan = self.lookup.plan(input_ids, gamma, room) if self.lookup is not None else None  # before any drafting
        if plan is not None and plan.source == "lookup":  # no drafter pass
            drafts, confidences = torch.tensor(plan.lookup_tokens), None
            draft_logits = one_hot_logits(drafts, self.drafter.config.vocab_size) if self.do_sample else None
            scheduled = plan.length
        else:
            forced = torch.tensor(plan.lookup_tokens) if plan is not None and plan.source == "hybrid" else None
            block = self.drafter.draft(
                self.context, int(input_ids[0, -1]), gamma, self.do_sample, self.logits_processor, input_ids,
                forced_tokens=forced,
            )
            if self.lookup is not None:
                self.lookup.observe_block(block.confidences)
            drafts, confidences, draft_logits = block.tokens, block.confidences, block.logits
            scheduled = plan.length if forced is not None else self._prefix_length(block, gamma)
        length = self._before_stop_string(input_ids, drafts, scheduled)
        self.stats.rounds.append(
            RoundStats(
                drafted=drafts.numel(),
                scheduled=length,
                draft_tokens=drafts.tolist(),
                confidences=confidences.tolist() if confidences is not None else [],
                draft_ms=1e3 * (time.perf_counter() - start),
                lookup=len(plan.lookup_tokens) if plan is not None else 0,
            )
        )
        self._verify_start = time.perf_counter()
        candidates = torch.cat([input_ids, drafts[:length][None].to(input_ids.device)], dim=-1)
        logits = draft_logits[None, :length] if self.do_sample and length > 0 else None
        return candidates, logits

    def _extend_context(self, input_ids, model_outputs):
        """Append the hidden states of positions ``context.length .. L-2`` (all accepted) to the cache."""
        n_new = input_ids.shape[1] - 1 - self.context.length
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise RuntimeError("DSpark needs the target's hidden states; the target did not return them.")
        states = model_outputs.hidden_states
        features = torch.cat([states[i + 1][:, :n_new] for i in self.drafter.config.target_layer_ids], dim=-1)
        self.drafter.extend_context(self.context, features.to(self.drafter.context_proj.weight.device))

    def _prefix_length(self, block, gamma: int) -> int:
        """ℓ in 0..γ by the verification mode (paper §3.2.2 for ``scheduler``, §5.2 for ``async``).

        ``async`` runs the global search (:func:`schedule_global`) on ``[c_1, c'_2, ..., c'_γ]``: ``c_1``
        of this block, which depends only on the anchor and the context (not on any draft), and
        ``c'_k`` of the PREVIOUS block, so no draft's admission depends on a draft of its own block
        and the search stays lossless (Appendix A). The first round verifies the whole block.
        """
        if self.mode == "fixed":
            return gamma
        if self.mode == "threshold":
            return threshold_prefix(block.confidences, self.threshold)
        confidences = self.drafter.calibration.apply(block.confidences.float())
        sps = self.sps.at(self._verify_context)[: gamma + 1]
        if self.mode == "scheduler":
            return schedule_prefix(confidences, sps)
        previous, self._previous = self._previous, confidences
        if previous is None:
            return gamma
        return schedule_global(torch.cat([confidences[:1], previous[1:gamma]]), sps)

    def _before_stop_string(self, input_ids, drafts, length: int) -> int:
        """Shorten ℓ so that no draft COMPLETES a stop string.

        transformers checks stop strings only at the end of the sequence after each round; a stop string
        completed inside an accepted block would be missed. Keeping such a draft out of the verified
        prefix leaves it to be produced as the round's last (bonus) token, where the check sees it.
        """
        if self.stop_strings is None or length == 0:
            return length
        candidates = torch.cat([input_ids, drafts[:length][None].to(input_ids.device)], dim=-1)
        for k in range(1, length + 1):
            if bool(self.stop_strings(candidates[:, : input_ids.shape[1] + k], None)[0]):
                return k - 1
        return length

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        """Record the number of accepted drafts and the verify time of the round just verified; in the
        scheduled modes the time also refines the SPS curve online (:meth:`~dspark_hf.SPSCurve.observe`)."""
        if self.lookup is not None:  # score the round's lookup continuation (dspark_hf.lookup)
            self.lookup.update(input_ids, num_matches)
        if self._verify_start is not None and self.stats.rounds:
            last = self.stats.rounds[-1]
            last.accepted = int(num_matches)
            last.verify_ms = 1e3 * (time.perf_counter() - self._verify_start)
            self._verify_start = None
            if self.mode in SCHEDULED_MODES and self.sps.online:  # B = ℓ + 1 tokens verified at this context
                self.sps.observe(last.scheduled + 1, self._verify_context, last.verify_ms / 1e3)


# ------------------------------------------------------------------------------------- routing
_stock_get_candidate_generator = GenerationMixin._get_candidate_generator
_stock_validate_generation_mode = GenerationMixin._validate_generation_mode


def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                             assistant_model=None, target_tokenizer=None, **kwargs):
    if isinstance(assistant_model, DSparkDrafter):
        return DSparkCandidateGenerator(
            self, assistant_model, generation_config, logits_processor, input_ids, target_tokenizer
        )
    return _stock_get_candidate_generator(
        self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
        assistant_model=assistant_model, target_tokenizer=target_tokenizer, **kwargs,
    )


def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
    assistant = generation_mode_kwargs.get("assistant_model")
    if isinstance(assistant, DSparkDrafter):
        _validate_dspark_call(generation_mode, generation_config)
        assistant.bind(self)  # shape checks with a clear message, before transformers' tokenizer check
    elif type(assistant).__name__ == DSparkDrafter.__name__:  # the trust_remote_code copy of the class
        raise ValueError(
            "This DSpark drafter was loaded through trust_remote_code before `import dspark_hf`, so generate() "
            "cannot route it. `import dspark_hf` and load it with `dspark_hf.DSparkDrafter.from_pretrained(...)`, "
            "or use `custom_generate=` with the drafter's repo."
        )
    return _stock_validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs)


def _validate_dspark_call(generation_mode, generation_config):
    """Reject what DSpark decoding cannot do, before any compute, naming the fix."""
    if generation_mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            f"DSpark drafting works with greedy decoding or sampling, not {generation_mode.value}; "
            "set num_beams=1 (and drop beam/contrastive options)."
        )
    if generation_config.num_return_sequences and generation_config.num_return_sequences > 1:
        raise ValueError("DSpark drafting returns one sequence per call; set num_return_sequences=1.")
    if generation_config.output_hidden_states and generation_config.return_dict_in_generate:
        raise ValueError(
            "output_hidden_states=True is not supported with a DSpark drafter (the drafter requests only its "
            "context layers); drop output_hidden_states or run the target separately."
        )
    if generation_config.speculation_type is not None:
        raise ValueError("speculation_type must be unset when the assistant is a DSparkDrafter.")


DSPARK_GENERATE_KWARGS = ("dspark_block_size", "dspark_verification", "dspark_threshold", "dspark_lookup")


def install() -> None:
    """Route DSpark drafters through :class:`DSparkCandidateGenerator` (idempotent; done on import)."""
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    for name in DSPARK_GENERATE_KWARGS:  # class defaults make `generate(dspark_...=...)` config fields
        if not hasattr(GenerationConfig, name):
            setattr(GenerationConfig, name, None)
