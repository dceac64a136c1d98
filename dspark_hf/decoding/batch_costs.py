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

    ``Θ_draft = R · t̄ / time(R · b̄, R, drafts)`` with ``t̄`` the tokens emitted and ``b̄`` the tokens verified per
    drafting request (running estimates), against ``Θ_plain = R / time(R, R, no drafts)``. All requests draft while
    no estimate exists or while ``Θ_draft > (1 + MARGIN) · Θ_plain``; otherwise the step is plain decoding, and
    every ``interval`` plain steps one request (in turn) drafts as a probe that refreshes the estimates at a
    ``1/R`` of a full drafter pass (``interval`` doubles up to :data:`MAX_PROBE_INTERVAL` while drafting loses,
    and returns to 1 when it wins).

    Attributes:
        tokens_per_request / verified_per_request: ``t̄`` and ``b̄`` (``None`` before the first drafting step).
    """

    tokens_per_request: float | None = None
    verified_per_request: float | None = None
    interval: int = 1
    plain_steps: int = 0

    def drafting_requests(self, costs: StepCosts, requests: int, context: int) -> int:
        """``requests``, 1 (a probe) or 0."""
        if self.tokens_per_request is None or not costs.draft_ms:
            return requests
        verified = max(requests, round(requests * self.verified_per_request))
        drafting = requests * self.tokens_per_request / costs.predict_ms(verified, requests, context, requests)
        plain = requests / costs.predict_ms(requests, requests, context)
        if drafting > (1 + MARGIN) * plain:
            self.interval, self.plain_steps = 1, 0
            return requests
        self.plain_steps += 1
        if self.plain_steps >= self.interval:
            self.plain_steps, self.interval = 0, min(2 * self.interval, MAX_PROBE_INTERVAL)
            return 1
        return 0

    def observe(self, drafted: int, emitted: int, verified: int) -> None:
        """A step where ``drafted`` requests drafted; they emitted ``emitted`` tokens and verified ``verified``."""
        t, b = emitted / drafted, verified / drafted
        if self.tokens_per_request is None:
            self.tokens_per_request, self.verified_per_request = t, b
        else:
            self.tokens_per_request = (1 - ONLINE_WEIGHT) * self.tokens_per_request + ONLINE_WEIGHT * t
            self.verified_per_request = (1 - ONLINE_WEIGHT) * self.verified_per_request + ONLINE_WEIGHT * b
