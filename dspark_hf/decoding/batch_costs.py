"""What one step of concurrent decoding costs, by total tokens B and by requests R, and the draft-or-not decision
made from it before anything is drafted (issue 24; paper §3.2.2's Θ = τ · SPS(B) for many requests).

    step time(B, R, drafts) = 1 / SPS(B) + overhead(R) + [drafts] · draft(R)

* ``1 / SPS(B)``: the target verifying ``B = Σ_r (1 + ℓ_r)`` tokens in one forward
  (:class:`~dspark_hf.runtime.sps.SPSCurve`, profiled to ``R·(γ+1)`` tokens and refined online by the engine's
  own forwards; cached on disk as the one-request curve is);
* ``overhead(R)``: the rest of a step (host bookkeeping, acceptance, KV rollback), learnt online per ``R``;
* ``draft(R)``: the drafter's one pass for ``R`` requests, learnt online per ``R`` (interpolated between the ``R``
  seen, proportional to ``R`` beyond them), so a closed loop whose ``R`` changes needs no new full pass to learn it.

A drafting step after plain ones also catches the drafter's contexts up (the features of the steps it did not draft
in, a newcomer's prompt): not this step's price, so left out of ``draft(R)``, but what a step that drafts only to
re-measure pays on top of it, so learnt too (``catch_up_ms``: per token caught up, by ``R``).

On this CPU plain batched decoding of 8 requests already verifies 8 tokens per step, so under load the right
answer is often "draft nothing": :class:`DraftGate` compares the expected throughput of a drafting step with that
of a plain one, from the past only, so the decision never looks at this step's drafts (lossless).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

ONLINE_WEIGHT = 0.2  # weight of a new observation in the running estimates
MARGIN = 0.10  # by the model, a drafting step must promise this much more throughput than a plain one
MEASURED_MARGIN = 0.05  # measured, drafting steps must reach this much more throughput than plain ones (noise)
CONFIRM_STEPS = 2  # drafting steps in a row a re-measure runs before its measurement can restart drafting
LOSS_BOUND = 0.02  # the gate's re-measures cost at most this share of the plain steps' time (unless the interval is
# at its cap)
PROBE_LOSS_BOUND = 0.01  # a request's probes (RoundPlanner.probe_wait) cost at most this share of its plain rounds:
# half the 2 % a prompt the drafter cannot follow may lose in all (issue #28), the rest left to its opening rounds
MAX_PROBE_INTERVAL = 64  # a request's plain rounds between two probes (RoundPlanner.probe_wait), at most
MAX_REMEASURE_INTERVAL = 512  # the gate's plain steps between two re-measures at one R, at most (DraftGate)


def _blend(table: dict[int, float], key: int, value: float) -> None:
    table[key] = value if key not in table else (1 - ONLINE_WEIGHT) * table[key] + ONLINE_WEIGHT * value


def _interpolate(table: dict[int, float], key: int, proportional: bool = False) -> float:
    """``table`` at ``key``: linear between the nearest known keys; outside them the nearest value (scaled by
    ``key / nearest`` when ``proportional``: a cost per request); 0 if empty."""
    if not table:
        return 0.0
    if key in table:
        return table[key]
    below, above = [k for k in table if k < key], [k for k in table if k > key]
    if not below or not above:
        nearest = max(below) if below else min(above)
        return table[nearest] * (key / nearest if proportional else 1.0)
    lo, hi = max(below), min(above)
    return table[lo] + (table[hi] - table[lo]) * (key - lo) / (hi - lo)


def priced_wait(interval: int, loss: float, cap: int, bound: float) -> int:
    """Plain steps (or rounds) to wait before a step that drafts only to measure the drafter again (the gate's
    re-measure, a request's probe: :meth:`~dspark_hf.decoding.lookup.RoundPlanner.probe_wait`): ``interval``, or
    more where that step's ``loss`` (in plain steps, ``>= 0``) would exceed ``bound`` of the steps waited, at most
    ``cap`` (a probe: :data:`MAX_PROBE_INTERVAL` and :data:`PROBE_LOSS_BOUND`; the gate: :data:`MAX_REMEASURE_INTERVAL`
    and :data:`LOSS_BOUND`)."""
    return min(max(interval, math.ceil(loss / bound)), cap)


@dataclass
class StepCosts:
    """The step-time model above.

    Attributes:
        sps: the target's SPS curve (``sps.at(context)[B - 1]`` steps/s for ``B`` tokens).
        overhead_ms / draft_ms: running estimates by number of requests ``R`` (ms).
        catch_up_ms: running estimates by ``R`` of the drafter's context catch-up per token caught up (ms).
    """

    sps: object
    overhead_ms: dict[int, float] = field(default_factory=dict)
    draft_ms: dict[int, float] = field(default_factory=dict)
    catch_up_ms: dict[int, float] = field(default_factory=dict)

    def observe(self, requests: int, overhead_ms: float, draft_ms: float | None = None) -> None:
        """Fold one step's measured overhead (and drafter pass, when it drafted) into the estimates for ``R``."""
        _blend(self.overhead_ms, requests, max(overhead_ms, 0.0))
        if draft_ms is not None:
            _blend(self.draft_ms, requests, draft_ms)

    def observe_catch_up(self, requests: int, ms: float, tokens: int) -> None:
        """Fold one step's catch-up at ``R`` (``tokens`` features of past steps and prompts joining the drafter's
        contexts in ``ms``) into :attr:`catch_up_ms`; nothing for ``tokens = 0``."""
        if tokens > 0:
            _blend(self.catch_up_ms, requests, ms / tokens)

    def catch_up(self, requests: int, tokens: int) -> float:
        """Predicted ms of a catch-up of ``tokens`` at ``requests`` (0 before any catch-up was measured)."""
        return _interpolate(self.catch_up_ms, requests) * tokens

    def verify_ms(self, tokens: int, context: int) -> float:
        """``1000 / SPS(B)`` at ``context`` (the curve's last entry, scaled by ``B``, past its end)."""
        row = self.sps.at(context)
        if tokens <= len(row):
            return 1e3 / row[tokens - 1]
        return 1e3 / row[-1] * tokens / len(row)

    def predict_ms(self, tokens: int, requests: int, context: int, drafting: int = 0) -> float:
        """Predicted wall time of a step verifying ``tokens`` for ``requests``, ``drafting`` of which drafted (ms)."""
        return self.verify_ms(tokens, context) + self._outside_ms(requests, drafting)

    def _outside_ms(self, requests: int, drafting: int) -> float:
        """A step's time beyond its verification (ms): ``overhead(R)`` and the drafter's pass counted as its share
        ``drafting / requests`` of a pass for all."""
        draft = _interpolate(self.draft_ms, requests, proportional=True) * drafting / requests
        return _interpolate(self.overhead_ms, requests) + draft

    def rates(self, requests: int, context: int, drafting: int = 0) -> list[float]:
        """Steps per second of a step for ``requests`` verifying ``B = 1..`` tokens (index ``B - 1``), its overhead
        and the drafter's pass for ``drafting`` of them included (as :meth:`predict_ms`): the table Algorithm 1 reads,
        a step's tokens over its whole time, as :meth:`~dspark_hf.SPSCurve.round_rates` is for one request."""
        extra = self._outside_ms(requests, drafting) / 1e3
        return [1.0 / (1.0 / s + extra) for s in self.sps.at(context)]

    def alone_rates(self, context: int, drafting: bool, max_tokens: int) -> list[float]:
        """:meth:`rates` of a request alone in flight verifying ``B = 1..max_tokens`` tokens, its verification read
        as the single-request path reads it (:meth:`~dspark_hf.SPSCurve.round_ms`: the sizes it can verify), so both
        paths price a round alike.

        Raises:
            ValueError: ``max_tokens`` outside ``1..sps.max_tokens``.
        """
        extra = self._outside_ms(1, int(drafting))
        return [1e3 / (ms + extra) for ms in self.sps.round_ms(context, max_tokens)]


@dataclass
class DraftGate:
    """Whether the next step at ``R`` requests drafts for all of them or for none (plain batched decoding), from what
    past steps did: no decision looks at a draft of its own step (lossless). Asked for ``R >= 2``: a request alone
    in flight is planned as the single-request path plans a round (:class:`~dspark_hf.decoding.lookup.RoundPlanner`).

    Drafting needs both checks:

    * the model: ``Θ_draft = R · t̄ / time(R · b̄, R, drafts)`` with ``t̄`` the tokens emitted and ``b̄`` the tokens
      verified per request in steps where all requests drafted (running estimates by ``R``, interpolated across
      ``R``), against ``Θ_plain = R / time(R, R, no drafts)``: ``Θ_draft > (1 +`` :data:`MARGIN` ``) · Θ_plain``;
    * the measurement at this ``R``: a plain step must have run (else the step is plain, which measures it), and
      once a drafting step ran, the measured tokens per ms of drafting steps must exceed that of plain steps by
      :data:`MEASURED_MARGIN` (the model can be wrong; what ran cannot).

    When drafting loses the step is plain, and after ``wait`` plain steps one step drafts again to re-measure (and
    goes on drafting while the checks favour it; ``interval`` returns to 1 only once :data:`CONFIRM_STEPS` drafting
    steps in a row won, so one lucky step does not restart the re-measures' clock). ``wait`` is ``interval(R)``, or
    more where a re-measure would otherwise cost more than :data:`LOSS_BOUND` of the plain steps' time
    (:meth:`remeasure_cost` / ``LOSS_BOUND``, the catch-up it would run first included: it grows with the steps
    waited), at most :data:`MAX_REMEASURE_INTERVAL`; each re-measure doubles it. So at an ``R`` where re-measures
    keep losing, their share of the plain steps falls geometrically (``LOSS_BOUND`` at the first, half that at the
    next, ...) down to ``remeasure_cost / MAX_REMEASURE_INTERVAL``, and the next re-measure is at most that many
    steps away when drafting starts to pay at that ``R``. The cap is the gate's own, 8× a request's probe cap
    (:data:`MAX_PROBE_INTERVAL`): a re-measure at ``R = 8`` on the 2-core EPYC costs ~2 plain steps (a drafter pass
    for 8 requests, the catch-up over the steps skipped, ~16 tokens verified for τ = 1.0), so ``LOSS_BOUND`` wants
    ~100 steps between them; at a cap of 64 a 127-step loop ran 2-4 of them (2 timed: 239 and 277 ms against
    115 ms plain steps, 1.6 % of the loop) and the scheduler reached 0.968× plain batched decoding (lockstep,
    2 threads; 0.996-1.008× with the gate held shut), issue 24; at a cap of 512, 0.989× at ``R = 8`` and 0.996× at
    ``R = 4`` (one re-measure or none per loop, 0-1 % of it).

    One gate (with its :class:`StepCosts`) serves every call of a drafter with the same settings
    (:func:`learnt_costs`), so a call starts from what the previous ones learnt, the re-measure intervals included.

    Attributes:
        tokens_per_request / verified_per_request: ``t̄`` and ``b̄`` by ``R`` (empty before the first drafting step).
        drafting_rate / plain_rate: measured tokens per ms of steps by ``R`` where all requests drafted / none did.
        streak: drafting steps in a row at ``R`` (since the last plain step there).
        interval / plain_steps: by ``R``, the next ``wait``'s floor and plain steps since the last re-measure.
    """

    tokens_per_request: dict[int, float] = field(default_factory=dict)
    verified_per_request: dict[int, float] = field(default_factory=dict)
    drafting_rate: dict[int, float] = field(default_factory=dict)
    plain_rate: dict[int, float] = field(default_factory=dict)
    streak: dict[int, int] = field(default_factory=dict)
    interval: dict[int, int] = field(default_factory=dict)
    plain_steps: dict[int, int] = field(default_factory=dict)

    def model_ratio(self, costs: StepCosts, requests: int, context: int) -> float:
        """``Θ_draft / Θ_plain`` at ``requests`` by the model (the ``R`` cancels: ``t̄ · time(R) / time(R·b̄)``)."""
        return (_interpolate(self.tokens_per_request, requests) * costs.predict_ms(requests, requests, context)
                / self._drafting_step_ms(costs, requests, context))

    def remeasure_cost(self, costs: StepCosts, requests: int, context: int, catch_up: int = 0) -> float:
        """What one drafting step costs beyond plain decoding, in plain steps: ``time(draft) / time(plain) ·
        (1 − rate ratio)``, the rate ratio measured at ``R`` when both rates are, else the model's (≥ 0), plus
        the catch-up of ``catch_up`` tokens it would run first (:meth:`StepCosts.catch_up` over ``time(plain)``)."""
        measured = self.drafting_rate.get(requests), self.plain_rate.get(requests)
        ratio = measured[0] / measured[1] if None not in measured else self.model_ratio(costs, requests, context)
        plain = costs.predict_ms(requests, requests, context)
        return (self._drafting_step_ms(costs, requests, context) / plain * max(0.0, 1.0 - ratio)
                + costs.catch_up(requests, catch_up) / plain)

    def _drafting_step_ms(self, costs: StepCosts, requests: int, context: int) -> float:
        """The model's time of a step where all ``requests`` draft and verify ``R · b̄`` tokens (ms)."""
        verified = max(requests, round(requests * _interpolate(self.verified_per_request, requests)))
        return costs.predict_ms(verified, requests, context, requests)

    def drafts(self, costs: StepCosts, requests: int, context: int, catch_up: int = 0) -> bool:
        """Whether the next step at ``requests`` drafts for all of them (``False``: a plain step); ``catch_up``: the
        tokens its drafter would catch up first (past steps' features and prompts not yet in the contexts)."""
        if not self.tokens_per_request or not costs.draft_ms:
            return True  # nothing known yet: draft, which measures it
        plain = self.plain_rate.get(requests)
        if plain is None:
            return False  # a plain step measures it (and never loses to plain decoding)
        drafting = self.drafting_rate.get(requests)
        if self.model_ratio(costs, requests, context) > 1 + MARGIN and (
                drafting is None or drafting > (1 + MEASURED_MARGIN) * plain):
            if self.streak.get(requests, 0) >= CONFIRM_STEPS:
                self.interval[requests] = 1
            return True
        self.plain_steps[requests] = self.plain_steps.get(requests, 0) + 1
        wait = self.interval.get(requests, 1)
        if self.plain_steps[requests] >= wait:  # time to re-measure, unless that would cost more than LOSS_BOUND
            cost = self.remeasure_cost(costs, requests, context, catch_up)
            wait = priced_wait(wait, cost, MAX_REMEASURE_INTERVAL, LOSS_BOUND)
        if self.plain_steps[requests] < wait:
            return False
        self.plain_steps[requests] = 0
        self.interval[requests] = min(2 * wait, MAX_REMEASURE_INTERVAL)
        return True

    def observe(self, requests: int, emitted: int, verified: int) -> None:
        """A step where all ``requests`` drafted: they emitted ``emitted`` tokens and verified ``verified``."""
        _blend(self.tokens_per_request, requests, emitted / requests)
        _blend(self.verified_per_request, requests, verified / requests)

    def observe_step(self, requests: int, drafted: int, emitted: int, step_ms: float) -> None:
        """A whole step's measured throughput (``emitted`` tokens of all requests in ``step_ms``) where ``drafted``
        requests drafted: kept per ``R`` for steps where all drafted or none did (a step where some had no room for
        drafts is neither); counts the drafting steps in a row at ``R``."""
        if drafted not in (0, requests):
            return
        self.streak[requests] = self.streak.get(requests, 0) + 1 if drafted else 0
        if step_ms > 0:
            _blend(self.drafting_rate if drafted else self.plain_rate, requests, emitted / step_ms)


_LEARNT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> {settings: (StepCosts, DraftGate)}


def learnt_costs(drafter, curve, settings: tuple) -> tuple[StepCosts, DraftGate]:
    """The cost model and gate of ``drafter`` on ``curve`` for ``settings`` (e.g. block size, mode, sampling):
    what the previous calls with them learnt (overhead(R), draft(R), t̄, b̄, measured rates), or new ones. Shared
    by the calls (and threads) using the drafter; a new curve starts afresh."""
    table = _LEARNT.setdefault(drafter, {})
    costs, gate = table.get(settings, (None, None))
    if costs is None or costs.sps is not curve:
        costs, gate = StepCosts(curve), DraftGate()
        table[settings] = costs, gate
    return costs, gate
