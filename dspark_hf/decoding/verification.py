"""Verification modes: how many of a block's γ drafts the target verifies (the prefix length ℓ).

One small policy class per mode (``dspark_verification=``), each saying what it needs from the drafter, so the
candidate generator, the bench and the demo read one table (:data:`POLICIES`) instead of re-deriving "which
modes can this drafter run":

========== ================ ============= ======================================================== ==============
mode       confidence head  calibration   ℓ                                                        paper
========== ================ ============= ======================================================== ==============
fixed      no               no            γ                                                        Table 1
threshold  yes              no            longest prefix with c_k >= t                             baseline
scheduler  yes              yes (γ)       Algorithm 1 on calibrated c_k and the SPS curve          §3.2.2, Alg. 1
async      yes              yes (γ)       global search on [c_1, c'_2..c'_γ] (c' of the previous    §5.2
                                          block)
========== ================ ============= ======================================================== ==============

Whether draft ``x_k`` is verified never depends on ``x_k`` itself, the condition for speculative sampling to
stay exact (Appendix A): see :meth:`VerificationPolicy.prefix_length` of each policy.
"""

from __future__ import annotations

import torch

# transformers' speculative sampling (Leviathan et al., Algorithm 1), the rule the one-request path runs in
# `_assisted_decoding`; `accept_drafts` applies it to one row of a batch. Exit condition: a public name for it.
from transformers.generation.utils import _speculative_sampling

from ..modeling.limits import VERIFICATION_MODES
from .scheduler import schedule_global, schedule_prefix, threshold_prefix


class VerificationPolicy:
    """One verification mode. Class attributes say what it needs; an instance lives for one ``generate`` call
    (``async`` keeps the previous block's confidences).

    Attributes:
        name: the ``dspark_verification`` value.
        needs_confidence: the drafter must have a confidence head.
        needs_calibration: the drafter must have a calibration (STS) covering γ positions, and the target's SPS
            curve is read and refined online.
    """

    name: str = ""
    needs_confidence: bool = True
    needs_calibration: bool = False

    def prefix_length(self, confidences: torch.Tensor | None, calibration, sps: list[float], gamma: int,
                      threshold: float) -> int:
        """ℓ in ``0..γ``.

        Args:
            confidences: ``[γ]`` raw c_k of the block (``None`` without a confidence head).
            calibration: the drafter's :class:`~dspark_hf.decoding.calibration.SequentialTemperatureScaling`.
            sps: SPS(1..γ+1) at the current context (steps per second when verifying B tokens).
            gamma: drafts in the block.
            threshold: ``dspark_threshold``.
        """
        raise NotImplementedError


class Fixed(VerificationPolicy):
    """Verify all γ drafts (the paper's Table 1 protocol)."""

    name, needs_confidence = "fixed", False

    def prefix_length(self, confidences, calibration, sps, gamma, threshold):
        return gamma


class Threshold(VerificationPolicy):
    """Verify while ``c_k >= threshold``; ℓ >= k depends on ``c_1..c_k``, and c_k on ``x_{k-1}`` only (eq. 7)."""

    name = "threshold"

    def prefix_length(self, confidences, calibration, sps, gamma, threshold):
        return threshold_prefix(confidences, threshold)


class Scheduler(VerificationPolicy):
    """Algorithm 1 with its early stop on calibrated confidences (survivals are non-increasing, so admission goes
    in position order and ℓ >= k depends on ``c_1..c_k`` only)."""

    name, needs_calibration = "scheduler", True

    def scheduled_confidences(self, confidences: torch.Tensor, calibration) -> tuple[torch.Tensor, bool]:
        """What the scheduler may see of this block: ``(confidences [≤ γ], early_stop)``; ``early_stop=False``
        allows the §5.2 global search (none of them depends on a draft of the block). Shared by one request
        (:meth:`prefix_length`) and many (:func:`~dspark_hf.decoding.scheduler.schedule_batch`)."""
        return calibration.apply(confidences.float()), True

    def prefix_length(self, confidences, calibration, sps, gamma, threshold):
        scheduled, early_stop = self.scheduled_confidences(confidences, calibration)
        return (schedule_prefix if early_stop else schedule_global)(scheduled, sps)


class Async(Scheduler):
    """The global search (:func:`~dspark_hf.decoding.scheduler.schedule_global`) on ``[c_1, c'_2, ..., c'_γ]``:
    ``c_1`` of this block depends only on the anchor and the context, ``c'_k`` are the PREVIOUS block's, so no
    draft's admission depends on a draft of its own block (paper §5.2, Appendix A). The first block, with no previous
    one, is scheduled as in ``"scheduler"`` (Algorithm 1 with its early stop)."""

    name, needs_calibration = "async", True

    def __init__(self):
        self.previous: torch.Tensor | None = None  # calibrated confidences of the previous block

    def scheduled_confidences(self, confidences, calibration):
        calibrated = calibration.apply(confidences.float())
        previous, self.previous = self.previous, calibrated
        if previous is None:  # the first block: Algorithm 1's non-anticipating early stop (as "scheduler")
            return calibrated, True
        return torch.cat([calibrated[:1], previous[1:calibrated.numel()]]), False


POLICIES: dict[str, type[VerificationPolicy]] = {p.name: p for p in (Scheduler, Async, Fixed, Threshold)}


def unmet_need(drafter, mode: str, gamma: int | None = None) -> str | None:
    """What ``drafter`` lacks to run ``mode``: ``"mode"`` (unknown), ``"confidence"`` (no confidence head),
    ``"calibration"`` (none), ``"calibration_length"`` (covers fewer than ``gamma`` positions), or ``None``."""
    policy = POLICIES.get(mode)
    if policy is None:
        return "mode"
    if policy.needs_confidence and drafter.confidence is None:
        return "confidence"
    if policy.needs_calibration and drafter.calibration is None:
        return "calibration"
    if policy.needs_calibration and gamma is not None and len(drafter.calibration.temperatures) < gamma:
        return "calibration_length"
    return None


def runnable_modes(drafter, gamma: int | None = None, order=VERIFICATION_MODES) -> list[str]:
    """The modes of ``order`` that ``drafter`` can run (at block size ``gamma`` when given)."""
    return [m for m in order if unmet_need(drafter, m, gamma) is None]


def accept_drafts(prefix_ids: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor | None,
                  target_logits: torch.Tensor, do_sample: bool) -> list[int]:
    """The target's verdict on one request's verified drafts: the accepted drafts and the bonus/correction token.

    The rule of transformers' assisted loop for one row: greedy keeps the drafts that equal the target's argmax
    and appends the argmax after the last one; sampling is transformers' ``_speculative_sampling`` (exact in law
    when each draft was sampled from ``softmax(draft_logits)``), and a row without drafts samples the target's
    processed distribution.

    Args:
        prefix_ids: ``[1, L]`` the request's tokens, the anchor last (only read for its length when sampling).
        drafts: ``[ℓ]`` verified drafts (``ℓ >= 0``).
        draft_logits: ``[ℓ, V]`` the distributions the drafts were sampled from (sampling with ``ℓ > 0``), or ``None``.
        target_logits: ``[ℓ + 1, V]`` float32 target logits after the logits processors; row ``i`` predicts the
            token after ``prefix + drafts[:i]``.
        do_sample: sampling (else greedy).

    Returns:
        ``list[int]`` of ``n + 1`` tokens: the ``n`` accepted drafts then the target's own token.

    Raises:
        ValueError: sampling with drafts but without their logits (the acceptance test divides by them).
    """
    length = drafts.numel()
    if not do_sample:
        selected = target_logits.argmax(-1)  # [ℓ + 1]
        n = int((drafts == selected[:length]).long().cumprod(0).sum()) if length else 0
        return selected[: n + 1].tolist()  # the n accepted drafts equal the argmax they matched
    if length == 0:
        return torch.multinomial(target_logits[0].softmax(-1), 1).tolist()
    if draft_logits is None:
        raise ValueError("sampled drafts need the logits they were sampled from (speculative sampling divides by q).")
    candidates = torch.cat([prefix_ids.reshape(1, -1), drafts.view(1, -1).to(prefix_ids.device)], dim=-1)
    tokens, _ = _speculative_sampling(candidates, draft_logits[None].float(), length, target_logits[None])
    return tokens[0].tolist()
