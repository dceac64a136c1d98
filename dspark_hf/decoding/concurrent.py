"""Many requests at once: DSpark rounds for R requests in ONE target forward per step (paper §3.2.2, Algorithm 1).

Each step (:meth:`ConcurrentDecoder.step`):

1. requests admitted since the last step are prefilled in the same ragged forward as the running requests'
   round (chunked-prefill style; their first token comes from it), so a newcomer never stalls the others;
2. every running request drafts a block of ``γ_r = min(γ, tokens left − 1)`` from its own context (the scheduled
   modes draft where it is expected to beat plain decoding: see :class:`ConcurrentDecoder`; a request alone in
   flight may propose prompt-lookup tokens instead, or with the drafter's, as one request's round does:
   :mod:`dspark_hf.decoding.alone`);
3. the verification mode picks ``ℓ_1 .. ℓ_R``: ``scheduler`` / ``async`` run Algorithm 1 across the requests
   (:func:`~dspark_hf.decoding.scheduler.schedule_batch`, the ``async`` mode as the §5.2 global search on
   confidences no draft of its block depends on), ``fixed`` verifies ``γ_r``, ``threshold`` the confident prefix;
4. one target forward verifies ``B = Σ_r (1 + ℓ_r)`` tokens, no padding (:mod:`dspark_hf.runtime.ragged`);
5. per request: acceptance (:func:`~dspark_hf.decoding.verification.accept_drafts`, greedy or exact speculative
   sampling), token budget / EOS / stop check, KV rollback to the accepted length, the accepted positions' target
   features kept for the drafter's context. A finished request leaves the batch and its caches are freed.

Without a drafter the same loop is plain batched decoding (``ℓ_r = 0``, one token per request per step): the
baseline runs through the same code. Entry points (:mod:`dspark_hf.decoding.batch_generate`):
``target.generate`` with a batch, and ``dspark_hf.generate_concurrent`` (a closed loop over a queue).

Greedy output of each request equals its own batch-1 plain ``generate`` (each segment sees only its own
request, at its own positions); sampled output is exact in law per request.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch

from ..modeling.drafting import warm_up
from ..modeling.modeling_dspark import DSparkDrafter
from ..modeling.outputs import DraftBlock
from ..runtime.capture import LayerCapture
from ..runtime.kernels import prepack_like
from ..runtime.profiling import ensure_sps_curve
from ..runtime.ragged import RaggedBatch, ragged_attention, ragged_forward
from .alone import DRAFTER_SOURCES, forced_tokens, lookup_proposal
from .batch_costs import DraftGate, StepCosts, learnt_costs
from .request import Request, RowOfBatch, prompt_ids
from .scheduler import schedule_batch
from .stats import BatchStats, RoundStats, StepStats
from .verification import POLICIES, accept_drafts, unmet_need

MAX_PROFILED_TOKENS = 128  # the longest SPS curve profiled on demand (B = Σ (1 + ℓ_r) beyond it is never scheduled)


class ConcurrentDecoder:
    """The concurrent decoding core: requests are added at any time, :meth:`step` advances all of them.

    Args:
        target: a causal LM whose attention is ``sdpa`` / ``eager`` (run as :data:`~dspark_hf.runtime.ragged.RAGGED`
            inside :meth:`running`).
        drafter: a :class:`DSparkDrafter`, or ``None`` for plain batched decoding through the same loop.
        block_size / verification / threshold: γ, the verification mode, the ``threshold`` mode's threshold
            (defaults: the drafter's config).
        do_sample: sampling (exact in law per request) or greedy.
        logits_processor: a ``LogitsProcessorList`` applied per request and position (stateless processors only,
            as for one request) to the request's ids after its ``padding`` (:meth:`add`), or ``None``.
        eos_token_ids: ids that end a request (kept in its output); ``None`` (default): the target's
            ``generation_config.eos_token_id`` (an id, a list of ids, or none), as plain ``generate`` stops;
            ``()`` for none.
        stop: ``(request, ids) -> bool`` called after each emitted token (stop strings, custom criteria); the
            request ends there. A function, not a list of strings (``TypeError`` otherwise, naming the lambda).
        max_requests: ``R``, the most requests in flight at once (:meth:`add` refuses more); the scheduled modes'
            SPS curve is profiled up to ``R·(γ+1)`` tokens (at most :data:`MAX_PROFILED_TOKENS`).
        sps: the SPS curve the scheduled modes read when it covers those tokens (else, and by default,
            :func:`~dspark_hf.runtime.profiling.ensure_sps_curve`: the drafter's, or the stored or newly measured
            one, at :meth:`running`'s start).
        lookup: in the scheduled modes, prompt lookup for a request alone in flight (default, as the single-request
            path's); ``False``: the drafter alone.

    Raises:
        ValueError: an unknown mode, a mode the drafter cannot run (no confidence head, no calibration covering
            γ), a threshold outside [0, 1], ``max_requests < 1``.
        TypeError: ``stop`` is not callable (e.g. a list of stop strings).

    Warns:
        UserWarning: a ``threshold`` with a mode other than ``threshold`` (it is ignored).

    In the scheduled modes a step with one request in flight is the round the single-request path's planner would
    run (:mod:`dspark_hf.decoding.alone`: prompt lookup, DSpark, a hybrid of both or the target alone, by Θ at the
    step rates at R = 1), a step with several drafts for all or none as a
    :class:`~dspark_hf.decoding.batch_costs.DraftGate` expects drafting to beat plain batched decoding
    (:class:`~dspark_hf.decoding.batch_costs.StepCosts`); both start from what earlier decoders with the same
    drafter, curve and settings learnt (:func:`~dspark_hf.decoding.batch_costs.learnt_costs`).
    """

    def __init__(self, target, drafter: DSparkDrafter | None = None, *, block_size: int | None = None,
                 verification: str | None = None, threshold: float | None = None, do_sample: bool = False,
                 logits_processor=None, eos_token_ids: Iterable[int] | None = None,
                 stop: Callable[[Request, list[int]], bool] | None = None, max_requests: int = 8, sps=None,
                 lookup: bool = True):
        self.target = target
        self.drafter = drafter.bind(target) if drafter is not None else None
        if drafter is not None:
            prepack_like(self.drafter, target)  # the drafter runs its target's CPU kernels
        cfg = drafter.config if drafter is not None else None
        self.block_size = int(block_size or (cfg.block_size if cfg else 0))
        self.mode = verification or (cfg.verification if cfg else "fixed")
        self.threshold = float(threshold if threshold is not None else (cfg.confidence_threshold if cfg else 0.0))
        if threshold is not None and drafter is not None and self.mode != "threshold":
            warnings.warn(f"A threshold ({threshold}) is read by the 'threshold' verification mode only; this decoder "
                          f"verifies in the {self.mode!r} mode and ignores it.", UserWarning, stacklevel=2)
        if drafter is not None:
            self._check_mode()
            warm_up(self.drafter, self.block_size)  # once per drafter and γ: no step pays the kernels' set-up
        self.do_sample, self.lookup = do_sample, lookup
        self.processors = logits_processor if logits_processor is not None and len(logits_processor) else None
        if eos_token_ids is None:
            eos_token_ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
            eos_token_ids = [] if eos_token_ids is None else [eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids
        self.eos = {int(t) for t in eos_token_ids}
        if stop is not None and not callable(stop):
            raise TypeError(f"stop must be a function (request, ids) -> bool called after each token, got {stop!r}; "
                            "for stop strings: stop=lambda request, ids: tokenizer.decode(ids).endswith(...).")
        self.stop = stop
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}.")
        self.max_requests = int(max_requests)
        self.sps = sps
        self.costs: StepCosts | None = None  # the scheduled modes' cost model and gate, from running()
        self.gate: DraftGate | None = None
        self._extend_ms, self._extend_tokens = 0.0, 0  # the last drafting step's context catch-up (ms; StepStats
        # .extend_ms) and the tokens it caught up
        self.requests: list[Request] = []
        self.stats = BatchStats()
        text = target.config.get_text_config(decoder=True)
        self.num_layers = text.num_hidden_layers
        self.capture: LayerCapture | None = None  # the drafter's context layers of the target, while running()

    def _check_mode(self):
        need = unmet_need(self.drafter, self.mode, self.block_size)
        if need is not None:
            raise ValueError({
                "mode": f"verification must be one of {tuple(POLICIES)}, got {self.mode!r}.",
                "confidence": f"the {self.mode!r} mode needs a confidence head; this drafter has none (use 'fixed').",
                "calibration": f"the {self.mode!r} mode needs a calibrated drafter (`dspark calibrate`); use 'fixed'.",
                "calibration_length": f"the calibration covers fewer than {self.block_size} positions; lower the "
                                      "block size or recalibrate.",
            }[need])
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 with a drafter, got {self.block_size}.")
        if self.mode == "threshold" and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be a probability in [0, 1], got {self.threshold}.")

    # ------------------------------------------------------------------------------------------ requests
    def add(self, prompt: Sequence[int], max_new_tokens: int, padding: Sequence[int] = (),
            batch_row: tuple[int, int] | None = None) -> Request:
        """Queue a request (prefilled at the next :meth:`step`).

        ``padding``: ids that logits processors see before the prompt (a batch row's left padding, as batched plain
        ``generate`` shows rows); never run by the target. ``batch_row``: ``(row, rows)`` when the processors were
        built for a batch of ``rows`` (``generate``'s): the request is row ``row`` of it (:class:`RowOfBatch`).

        Raises:
            ValueError: a prompt that is not token ids or is empty (:func:`~dspark_hf.decoding.request.prompt_ids`),
                ``max_new_tokens < 1``, or ``max_requests`` requests already in flight.
        """
        if len(self.active) >= self.max_requests:
            raise ValueError(f"{self.max_requests} requests are in flight (max_requests); step until one finishes.")
        prompt = prompt_ids(prompt)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        request = Request(len(self.requests), prompt, int(max_new_tokens), self.num_layers, self, padding)
        if self.processors is not None:
            request.processors = RowOfBatch(self.processors, *batch_row) if batch_row else self.processors
        self.requests.append(request)
        self.stats.rows.append(request.stats)
        self.stats.request_s.append(0.0)
        return request

    @property
    def active(self) -> list[Request]:
        return [r for r in self.requests if not r.done]

    @contextlib.contextmanager
    def running(self):
        """Context manager: the target runs ragged attention inside it
        (:func:`~dspark_hf.runtime.ragged.ragged_attention`) and, with a drafter, its context layers are recorded
        (:class:`~dspark_hf.runtime.capture.LayerCapture`); call :meth:`step` within it, in the same thread. The
        scheduled modes' SPS curve is loaded (or profiled) first, with the target's own attention."""
        if self.drafter is not None and POLICIES[self.mode].needs_calibration and self.costs is None:
            needed = max(min(self.max_requests * (self.block_size + 1), MAX_PROFILED_TOKENS), self.max_requests)
            if self.sps is None or self.sps.max_tokens < needed:  # a curve passed in wins when it covers the batch
                self.sps = ensure_sps_curve(self.target, self.drafter, needed)
            self.costs, self.gate = learnt_costs(self.drafter, self.sps, (self.block_size, self.mode, self.do_sample))
        with contextlib.ExitStack() as stack:
            stack.enter_context(ragged_attention(self.target))
            if self.drafter is not None:
                self.capture = stack.enter_context(LayerCapture(self.target, self.drafter.config.target_layer_ids))
            try:
                yield self
            finally:
                self.capture = None

    # ---------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        """Advance every active request by one target forward: a round of the running ones, with the prompts of the
        newly added ones prefilled in the same forward (or a prefill alone when none runs yet).

        Returns:
            ``{request index: tokens emitted}`` for the requests in the forward.
        """
        start = time.perf_counter()
        active = self.active
        running, fresh = [r for r in active if r.kv.length > 0], [r for r in active if r.kv.length == 0]
        emitted = self._round(running, fresh) if active else {}
        if self.stats.steps:
            step = self.stats.steps[-1]
            step.step_ms = 1e3 * (time.perf_counter() - start)
            if self.costs is not None and not step.prefill and not step.prefilled:
                # the context catch-up (a prompt, or the steps since a request last drafted) is left out: it
                # prices the past steps, not this one; a drafting step's own extension stays in. A step that also
                # prefilled is the prompts' price: it teaches neither the model nor the gate.
                self.costs.observe(step.requests, step.step_ms - step.verify_ms - step.draft_ms,
                                   step.draft_ms - step.extend_ms if step.drafted == step.requests else None)
                self.gate.observe_step(step.requests, step.drafted, sum(map(len, emitted.values())),
                                       step.step_ms - step.extend_ms)
                self.costs.observe_catch_up(step.requests, step.extend_ms, self._extend_tokens)
        return emitted

    def _round(self, requests: list[Request], fresh: list[Request]) -> dict[int, list[int]]:
        """Phases 2-5 for the running ``requests`` (draft, schedule, verify in one forward, accept and roll back per
        request), with the prompts of the ``fresh`` requests prefilled in the same ragged forward (chunked-prefill
        style: a newcomer's prompt never costs the running requests a step of their own); each fresh request's
        first token comes from its prompt's last position (phase 1).

        In the scheduled modes a step that prefills verifies the running requests' anchors only, without asking the
        gate: its time is mostly the prompts', so it measures neither drafting nor plain decoding. Whether a step
        drafts is decided before any of its drafts (lossless); ``fixed`` and ``threshold`` draft in any step.
        """
        contexts = [r.kv.length for r in requests]
        context = sum(contexts) // len(contexts) if requests else 0
        drafts, plan = self.drafter is not None and bool(requests), None
        if self.costs is not None and drafts:  # decided from past steps only: lossless
            alone = requests[0] if len(requests) == 1 and not fresh else None  # planned as one request's round
            plan = alone.planner.plan(alone.ids, self.costs, context, min(self.block_size, alone.room - 1),
                                      alone.room - 1) if alone else None
            drafts = plan.source in DRAFTER_SOURCES if alone else not fresh and self.gate.drafts(
                self.costs, len(requests), context, sum(r.catch_up_tokens for r in requests))
        draft_start, self._extend_ms, self._extend_tokens = time.perf_counter(), 0.0, 0
        blocks = self._draft(requests, forced_tokens(plan)) if drafts else [None] * len(requests)
        drafting = sum(b is not None for b in blocks)  # all, or fewer where requests have no room for drafts
        draft_ms = 1e3 * (time.perf_counter() - draft_start)
        if plan is not None and plan.length is not None:  # lookup, hybrid, target: ℓ planned with the step
            lengths, blocks = [plan.length], [lookup_proposal(plan, self.drafter.config.vocab_size, self.do_sample)
                                              if plan.source == "lookup" else blocks[0]]
        else:
            lengths = self._schedule(requests, blocks, context, drafting) if requests else []
        if plan is not None and plan.probe and drafting:  # a probe verifies a draft: the correction hears from it
            lengths[0] = max(lengths[0], 1)
        segments = [[r.ids[-1]] + (b.tokens[:n].tolist() if b is not None else []) for r, b, n in
                    zip(requests, blocks, lengths)]
        verified = sum(len(s) for s in segments)  # B of the round: all its rows are kept
        prompts = [r.ids for r in fresh]  # then the prompts: only their last rows are kept
        ends = verified + torch.tensor([len(p) for p in prompts], dtype=torch.long).cumsum(0) - 1
        predicted = 0.0
        if self.costs is not None and requests and not fresh:
            predicted = self.costs.predict_ms(verified, len(requests), context, drafting)
        logits, features = self._forward(requests + fresh, segments + prompts, torch.cat([torch.arange(verified), ends]))
        step = StepStats(len(requests) + len(fresh), verified + sum(map(len, prompts)), not requests, list(lengths),
                         draft_ms, self._last_forward_ms, predicted_ms=predicted, drafted=drafting,
                         extend_ms=self._extend_ms, prefilled=len(fresh))
        self.stats.steps.append(step)
        if self.costs is not None and self.sps.online and requests and not fresh:
            self.sps.observe(verified, context, step.verify_ms / 1e3)  # the curve learns this B at the mean context
        emitted, offset, forced = {}, 0, len(plan.lookup_tokens) if plan else 0  # a request alone's lookup tokens
        for request, block, n, segment, cached in zip(requests, blocks, lengths, segments, contexts):
            m = len(segment)
            rows = self._process(request, request.padding + request.ids + segment[1:], logits[offset:offset + m],
                                 start=len(request.padding) + len(request.ids))
            drafts = torch.tensor(segment[1:], dtype=torch.long)
            draft_logits = block.logits[:n] if block is not None and block.logits is not None else None
            tokens = accept_drafts(torch.tensor([request.ids]), drafts, draft_logits, rows, self.do_sample)
            accepted = len(tokens) - 1
            if request.planner is not None:  # what its next plans read (after this round)
                request.planner.observe_step(block, forced, n, tokens)
            request.kv.truncate(cached + 1 + accepted)  # the anchor and the accepted drafts stay (rollback)
            if features is not None:  # the anchor's and the accepted drafts' features join its drafter's context
                request.keep_features(features[:, offset:offset + 1 + accepted])
            offset += m
            out = self._emit(request, tokens)
            request.stats.rounds.append(RoundStats(
                drafted=block.tokens.numel() if block is not None else 0, scheduled=n, accepted=len(out) - 1,
                draft_tokens=block.tokens.tolist() if block is not None else [],
                confidences=block.confidences.tolist() if block is not None and block.confidences is not None else [],
                draft_ms=draft_ms / len(requests), verify_ms=step.verify_ms,
                lookup=forced))
            emitted[request.index] = out
        if requests and drafting == len(requests) and self.costs is not None:  # what the requests got
            self.gate.observe(len(requests), sum(len(emitted[r.index]) for r in requests), verified)
        for request, prompt, row in zip(fresh, prompts, range(verified, verified + len(fresh))):
            if features is not None:
                request.keep_features(features[:, offset:offset + len(prompt)])
            offset += len(prompt)
            first = self._process(request, request.padding + request.ids, logits[row:row + 1])
            token = accept_drafts(torch.tensor([request.ids]), torch.empty(0, dtype=torch.long), None, first,
                                  self.do_sample)
            emitted[request.index] = self._emit(request, token)
        return emitted

    # ------------------------------------------------------------------------------------------ phases
    def _draft(self, requests: list[Request], forced: torch.Tensor | None = None) -> list[DraftBlock | None]:
        """A block of ``γ_r = min(γ, room − 1)`` drafts per request, all in one drafter pass
        (:meth:`~dspark_hf.DSparkDrafter.draft_many` at the largest ``γ_r``, each block cut to its ``γ_r``; a request
        alone may have its first drafts ``forced`` ``[k]``); ``None`` for a request without room (or drafter)."""
        gammas = [min(self.block_size, r.room - 1) if self.drafter is not None else 0 for r in requests]
        drafting = [r for r, g in zip(requests, gammas) if g > 0]
        if not drafting:
            return [None] * len(requests)
        for request in drafting:  # the accepted positions' features join the context (paper Fig. 1)
            if request.pending:
                catch_up, start = request.catch_up_tokens, time.perf_counter()
                features = request.take_features()
                self.drafter.extend_context(request.context, features.to(self.drafter.context_proj.weight.device))
                self._extend_ms += 1e3 * (time.perf_counter() - start) if catch_up else 0.0
                self._extend_tokens += catch_up
        ids = [torch.tensor([r.padding + r.ids]) for r in drafting] if self.processors is not None else None
        processors = [r.processors for r in drafting] if self.processors is not None else None
        blocks = iter(self.drafter.draft_many([r.context for r in drafting], [r.ids[-1] for r in drafting],
                                              max(gammas), self.do_sample, processors, ids, forced_tokens=forced))
        return [next(blocks).prefix(g) if g > 0 else None for g in gammas]

    def _schedule(self, requests: list[Request], blocks, context: int, drafting: int) -> list[int]:
        """``ℓ_r`` per request by the verification mode (0 for a request without a block). The scheduled modes run
        Algorithm 1 across the requests on the step's rates at their mean ``context``: its overhead and the drafter
        pass of the ``drafting`` requests included, as the single-request path weighs a round; each request's
        confidences calibrated and corrected by its own online correction (``Request.calibration``)."""
        if all(b is None for b in blocks):
            return [0] * len(requests)
        policy = POLICIES[self.mode]
        if not policy.needs_calibration:
            return [0 if b is None else requests[i].policy.prefix_length(
                b.confidences, self.drafter.calibration, None, b.tokens.numel(), self.threshold)
                for i, b in enumerate(blocks)]
        scheduled, early_stop = [], False
        for request, block in zip(requests, blocks):
            if block is None:  # verifies its anchor only: one token of B that no candidate of its own can join
                scheduled.append(torch.zeros(1))
                continue
            confidences, stops = request.policy.scheduled_confidences(block.confidences, request.calibration)
            scheduled.append(confidences)
            early_stop = early_stop or stops
        lengths = schedule_batch(scheduled, self.costs.rates(len(requests), context, drafting), early_stop=early_stop)
        return [min(n, b.tokens.numel()) if b is not None else 0 for n, b in zip(lengths, blocks)]

    def _forward(self, requests: list[Request], segments: list[list[int]], keep: torch.Tensor):
        """One ragged target forward, timed.

        Returns:
            ``(logits [K, V], features)``: ``features`` ``[1, B, m·d]`` the drafter's context layers of all ``B``
            rows side by side, concatenated once for the step (each request keeps a view of its rows, so the step
            costs one copy, not one per request), or ``None`` without a drafter.
        """
        device = self.target.device
        ids = torch.tensor([[t for s in segments for t in s]], device=device)
        batch = RaggedBatch([r.kv for r in requests], [len(s) for s in segments])
        start = time.perf_counter()
        logits = ragged_forward(self.target, ids, batch, keep.to(device))
        self._last_forward_ms = 1e3 * (time.perf_counter() - start)
        return logits, (self.capture.features() if self.drafter is not None else None)

    def _process(self, request: Request, ids: list[int], logits: torch.Tensor, start: int | None = None):
        """Apply the request's logits processors to ``logits [m, V]``; row ``i`` follows ``ids[:start + i]``."""
        if request.processors is None:
            return logits
        start = len(ids) if start is None else start
        prefix = torch.tensor([ids], device=logits.device)
        return torch.cat([request.processors(prefix[:, :start + i], logits[i:i + 1]) for i in range(logits.shape[0])])

    def _emit(self, request: Request, tokens: list[int]) -> list[int]:
        """Append ``tokens`` up to the budget, the first EOS or the first stop; finish and free the request there."""
        out, stopped = [], False
        for token in tokens[: request.room]:
            request.ids.append(token)
            out.append(token)
            if token in self.eos or (self.stop is not None and self.stop(request, request.ids)):
                stopped = True
                break
        if stopped or request.room <= 0:
            self._finish(request)
        return out

    def _finish(self, request: Request) -> None:
        """Release a finished request and record its time in flight."""
        request.release()
        self.stats.request_s[request.index] = request.finished_s - request.added_s
