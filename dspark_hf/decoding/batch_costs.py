"""What one step of concurrent decoding costs, by total tokens B and by requests R, and the draft-or-not decision
made from it before anything is drafted (issue 24; paper §3.2.2's Θ = τ · SPS(B) for many requests).

    step time(B, R, drafts) = 1 / SPS(B) + overhead(R) + [drafts] · draft(R)

* ``1 / SPS(B)``: the target verifying ``B = Σ_r (1 + ℓ_r)`` tokens in one forward
  (:class:`~dspark_hf.runtime.sps.SPSCurve`, profiled to ``R·(γ+1)`` tokens and refined online by the engine's
  own forwards; cached on disk as the one-request curve is);
* ``overhead(R)``: the rest of a step (host bookkeeping, acceptance, KV rollback), learnt online per ``R``;
* ``draft(R)``: the drafter's one pass for ``R`` requests, learnt online per ``R`` (interpolated between the ``R``
  seen, proportional to ``R`` beyond them), so a closed loop whose ``R`` changes needs no new full pass to learn it.

On this CPU plain batched decoding of 8 requests already verifies 8 tokens per step, so under load the right
answer is often "draft nothing": :class:`DraftGate` compares the expected throughput of a drafting step with that
of a plain one, from the past only, so the decision never looks at this step's drafts (lossless).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

ONLINE_WEIGHT = 0.2  # weight of a new observation in the running estimates
MARGIN = 0.10  # a drafting step must promise this much more throughput than a plain one (estimates are noisy)
MAX_PROBE_INTERVAL = 64  # plain steps between two probes that draft, at most (the interval doubles up to it)


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


@dataclass
class StepCosts:
    """The step-time model above.

    Attributes:
        sps: the target's SPS curve (``sps.at(context)[B - 1]`` steps/s for ``B`` tokens).
        overhead_ms / draft_ms: running estimates by number of requests ``R`` (ms).
    """

    sps: object
    overhead_ms: dict[int, float] = field(default_factory=dict)
    draft_ms: dict[int, float] = field(default_factory=dict)

    def observe(self, requests: int, overhead_ms: float, draft_ms: float | None = None) -> None:
        """Fold one step's measured overhead (and drafter pass, when it drafted) into the estimates for ``R``."""
        _blend(self.overhead_ms, requests, max(overhead_ms, 0.0))
        if draft_ms is not None:
            _blend(self.draft_ms, requests, draft_ms)

    def verify_ms(self, tokens: int, context: int) -> float:
        """``1000 / SPS(B)`` at ``context`` (the curve's last entry, scaled by ``B``, past its end)."""
        row = self.sps.at(context)
        if tokens <= len(row):
            return 1e3 / row[tokens - 1]
        return 1e3 / row[-1] * tokens / len(row)

    def predict_ms(self, tokens: int, requests: int, context: int, drafting: int = 0) -> float:
        """Predicted wall time of a step verifying ``tokens`` for ``requests``, ``drafting`` of which drafted (ms;
        the drafter's pass counted as its share ``drafting / requests`` of a pass for all)."""
        draft = _interpolate(self.draft_ms, requests, proportional=True) * drafting / requests
        return self.verify_ms(tokens, context) + _interpolate(self.overhead_ms, requests) + draft

    def rates(self, requests: int, context: int) -> list[float]:
        """Steps per second of a step verifying ``B = 1..`` tokens, its overhead included (the table Algorithm 1
        reads once the drafts exist: the drafter's pass is paid by then)."""
        extra = _interpolate(self.overhead_ms, requests) / 1e3
        return [1.0 / (1.0 / s + extra) for s in self.sps.at(context)]


@dataclass
class DraftGate:
    """How many requests the next step drafts for, from what past steps did: all of them, one (a probe) or none.

    Two checks, both from past steps only (so no decision looks at a draft of its own step: lossless):

    * the model: ``Θ_draft = R · t̄ / time(R · b̄, R, drafts)`` with ``t̄`` the tokens emitted and ``b̄`` the tokens
      verified per drafting request at this ``R`` (running estimates, interpolated across ``R``), against
      ``Θ_plain = R / time(R, R, no drafts)``; drafting needs ``Θ_draft > (1 + MARGIN) · Θ_plain``;
    * the measurement: once steps at this ``R`` of both kinds have run, the measured tokens per ms of drafting
      steps (all ``R`` drafting) must exceed that of plain ones (the model can be wrong; what ran cannot).

    All requests draft while nothing is known or while both checks favour drafting; otherwise the step is plain
    decoding, and every ``interval`` plain steps one step drafts again (``interval`` doubles up to
    :data:`MAX_PROBE_INTERVAL` while drafting loses, and returns to 1 when it wins): for all requests when only
    the measurement is against drafting (to measure it again), else for one request (in turn) as a probe that
    refreshes ``t̄``, ``b̄`` at ``1/R`` of a full drafter pass.

    One gate (with its :class:`StepCosts`) serves every call of a drafter with the same settings
    (:func:`learnt_costs`), so a call starts from what the previous ones learnt.

    Attributes:
        tokens_per_request / verified_per_request: ``t̄`` and ``b̄`` by ``R`` (empty before the first drafting step).
        drafting_rate / plain_rate: measured tokens per ms of steps where all ``R`` requests drafted / none did.
    """

    tokens_per_request: dict[int, float] = field(default_factory=dict)
    verified_per_request: dict[int, float] = field(default_factory=dict)
    drafting_rate: dict[int, float] = field(default_factory=dict)
    plain_rate: dict[int, float] = field(default_factory=dict)
    interval: int = 1
    plain_steps: int = 0

    def drafting_requests(self, costs: StepCosts, requests: int, context: int) -> int:
        """``requests``, 1 (a probe) or 0."""
        if not self.tokens_per_request or not costs.draft_ms:
            return requests
        verified = max(requests, round(requests * _interpolate(self.verified_per_request, requests)))
        drafting = (requests * _interpolate(self.tokens_per_request, requests)
                    / costs.predict_ms(verified, requests, context, requests))
        model_wins = drafting > (1 + MARGIN) * requests / costs.predict_ms(requests, requests, context)
        measured = self.drafting_rate.get(requests), self.plain_rate.get(requests)
        if model_wins and (None in measured or measured[0] > measured[1]):
            self.interval, self.plain_steps = 1, 0
            return requests
        self.plain_steps += 1
        if self.plain_steps >= self.interval:
            self.plain_steps, self.interval = 0, min(2 * self.interval, MAX_PROBE_INTERVAL)
            return requests if model_wins else 1
        return 0

    def observe(self, requests: int, drafted: int, emitted: int, verified: int) -> None:
        """A step of ``requests`` where ``drafted`` of them drafted; those emitted ``emitted`` tokens and verified
        ``verified``."""
        _blend(self.tokens_per_request, requests, emitted / drafted)
        _blend(self.verified_per_request, requests, verified / drafted)

    def observe_step(self, requests: int, drafted: int, emitted: int, step_ms: float) -> None:
        """A whole step's measured throughput (``emitted`` tokens of all requests in ``step_ms``): kept per ``R``
        for steps where all requests drafted or none did (a probe's is neither)."""
        if step_ms > 0 and drafted in (0, requests):
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
