"""Tests for Sequential Temperature Scaling and the calibration metrics (paper §3.2.1, §4)."""

import json
import math

import pytest
import torch

from dspark_hf.decoding.calibration import (
    OnlineCorrection,
    SequentialTemperatureScaling,
    reliability_diagram,
    scale_temperature,
)
from dspark_hf.metrics import brier_score, expected_calibration_error, roc_auc

PROBS = torch.tensor([0.1, 0.4, 0.35, 0.8])
LABELS = torch.tensor([0, 0, 1, 1])


def test_ece_hand_example():
    # 2 bins: [0, .5) holds .1, .4, .35 (mean .2833, rate 1/3); [.5, 1] holds .8 (rate 1).
    expected = 3 / 4 * abs(0.85 / 3 - 1 / 3) + 1 / 4 * abs(0.8 - 1)
    assert expected_calibration_error(PROBS, LABELS, n_bins=2) == pytest.approx(expected)
    assert expected_calibration_error(torch.tensor([1.0, 0.0]), torch.tensor([1, 0])) == 0.0


def test_roc_auc_hand_examples():
    # Positives .35, .8 vs negatives .1, .4: 3 of 4 pairs ordered correctly.
    assert roc_auc(PROBS, LABELS) == pytest.approx(0.75)
    assert roc_auc(torch.tensor([0.5, 0.5, 0.2]), torch.tensor([0, 1, 0])) == pytest.approx(0.75)  # tie = 1/2
    assert math.isnan(roc_auc(PROBS, torch.ones(4)))


def test_brier_hand_example():
    assert brier_score(PROBS, LABELS) == pytest.approx((0.01 + 0.16 + 0.4225 + 0.04) / 4)


def synthetic_rounds(n=2000, gamma=4, seed=0):
    """Fixed-length rounds whose raw confidences are over-confident: c = sigmoid(3 · logit(p))."""
    g = torch.Generator().manual_seed(seed)
    p = 0.3 + 0.65 * torch.rand(n, gamma, generator=g, dtype=torch.float64)  # true conditional probs
    survive = torch.rand(n, gamma, generator=g, dtype=torch.float64) < p  # (N, γ)
    accepted = survive.long().cumprod(dim=1).sum(dim=1)  # leading successes, (N,)
    return torch.sigmoid(3 * torch.logit(p)), accepted


@pytest.fixture(scope="module")
def fitted():
    c, accepted = synthetic_rounds()
    return SequentialTemperatureScaling().fit(c, accepted), c, accepted


def test_sts_reduces_ece_at_every_position(fitted):
    sts, c, accepted = fitted
    report = sts.report(c, accepted)
    for pos in report["positions"]:
        assert pos["ece_after"] < pos["ece_before"], pos
        assert pos["brier_after"] < pos["brier_before"], pos
    assert 2.0 < sts.temperatures[0] < 4.5  # the true temperature is 3
    assert report == sts.fit_report


def test_sts_preserves_order(fitted):
    sts, c, _ = fitted
    calibrated = sts.apply(c)
    assert calibrated.shape == c.shape
    for k in range(c.shape[1]):
        order = torch.argsort(c[:, k])
        assert bool((calibrated[order, k].diff() >= 0).all())
    assert sts.apply(c[0]).shape == c[0].shape  # (γ,) input
    assert sts.apply(c[:, :2]).shape == (c.shape[0], 2)  # fewer positions than fitted


def test_save_load_round_trip(fitted, tmp_path):
    sts, c, _ = fitted
    written = sts.save(tmp_path / "drafter")
    assert written.name == "calibration.json"
    assert json.loads(written.read_text())["format_version"] == 1
    loaded = SequentialTemperatureScaling.load(tmp_path / "drafter")
    assert loaded.temperatures == sts.temperatures
    assert loaded.fit_report == sts.fit_report
    torch.testing.assert_close(loaded.apply(c), sts.apply(c))


def test_reliability_diagram_writes_png(fitted, tmp_path):
    sts, c, accepted = fitted
    out = reliability_diagram(c[:200], accepted[:200], sts, tmp_path / "rel.png", pooled=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scale_temperature_identity_and_extremes():
    c = torch.tensor([0.0, 0.2, 0.9, 1.0], dtype=torch.float64)
    torch.testing.assert_close(scale_temperature(c, 1.0), c)
    assert scale_temperature(c, 3.0)[[0, 3]].tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda sts: sts.apply(torch.rand(3, 5)), "γ = 5"),
        (lambda sts: SequentialTemperatureScaling().apply(torch.rand(4)), "fit"),
        (lambda sts: sts.fit(torch.rand(3, 2), torch.tensor([0, 1, 3])), "0..γ"),
        (lambda sts: sts.fit(torch.rand(3, 2), torch.tensor([0.0, 1.0, 2.0])), "integer"),
        (lambda sts: sts.fit(torch.rand(3), torch.tensor([0, 1, 1])), r"\(N, γ\)"),
        (lambda sts: sts.fit(torch.rand(3, 2), torch.tensor([0, 1, 1]), grid=[]), "grid"),
        (lambda sts: expected_calibration_error(torch.tensor([]), torch.tensor([])), "empty"),
        (lambda sts: expected_calibration_error(torch.tensor([1.5]), torch.tensor([1])), r"\[0, 1\]"),
        (lambda sts: roc_auc(PROBS, torch.tensor([0, 2, 1, 0])), "0/1"),
        (lambda sts: SequentialTemperatureScaling([0.0]), "> 0"),
    ],
)
def test_bad_input_raises(fitted, call, message):
    with pytest.raises(ValueError, match=message):
        call(fitted[0])


# ----------------------------------------------------------------------------- online correction
def test_online_correction_matches_the_means_of_the_verified_drafts():
    correction = OnlineCorrection(prior=2.0)
    assert correction.factor == 1.0  # no round yet: the calibration as it is
    correction.observe([0.6, 0.5], 0)  # draft 1 rejected: only position 1 was reached
    assert correction.factor == pytest.approx(2 / 2.6)
    correction.observe([0.8, 0.5, 0.4], 3)  # all accepted: every position reached
    assert correction.factor == pytest.approx((3 + 2) / (0.6 + 1.7 + 2))
    f = (3 + 2) / 4.3
    assert correction.apply(torch.tensor([0.5, 0.9])).tolist() == pytest.approx([0.5 * f, 1.0])  # capped at 1
    with pytest.raises(ValueError, match="accepted must be in 0..2"):
        correction.observe([0.5, 0.5], 3)
    with pytest.raises(ValueError, match="prior must be > 0"):
        OnlineCorrection(prior=0)


def test_failing_drafts_halve_the_estimates_within_a_few_rounds():
    """Calibrated c_1 = 0.6, always rejected: after three rounds f = 2 / 3.8 (< 0.55)."""
    correction = OnlineCorrection()
    for _ in range(3):
        correction.observe([0.6, 0.6, 0.6], 0)
    assert correction.factor == pytest.approx(2 / 3.8) and correction.factor < 0.55
