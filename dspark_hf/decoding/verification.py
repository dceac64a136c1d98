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

from ..modeling.configuration_dspark import VERIFICATION_MODES
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

    def prefix_length(self, confidences, calibration, sps, gamma, threshold):
        return schedule_prefix(calibration.apply(confidences.float()), sps)


class Async(VerificationPolicy):
    """The global search (:func:`~dspark_hf.decoding.scheduler.schedule_global`) on ``[c_1, c'_2, ..., c'_γ]``:
    ``c_1`` of this block depends only on the anchor and the context, ``c'_k`` are the PREVIOUS block's, so no
    draft's admission depends on a draft of its own block (paper §5.2, Appendix A). The first block, with no previous
    one, is scheduled as in ``"scheduler"`` (Algorithm 1 with its early stop)."""

    name, needs_calibration = "async", True

    def __init__(self):
        self.previous: torch.Tensor | None = None  # calibrated confidences of the previous block

    def prefix_length(self, confidences, calibration, sps, gamma, threshold):
        calibrated = calibration.apply(confidences.float())
        previous, self.previous = self.previous, calibrated
        if previous is None:  # the first block: Algorithm 1's non-anticipating early stop (as "scheduler")
            return schedule_prefix(calibrated, sps)
        return schedule_global(torch.cat([calibrated[:1], previous[1:gamma]]), sps)


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
