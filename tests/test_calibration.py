"""Tests for Sequential Temperature Scaling and the calibration metrics (paper §3.2.1, §4)."""

import json
import math

import pytest
import torch

from dspark_hf.decoding import calibration
from dspark_hf.decoding.calibration import (
    DEFAULT_GRID,
    CorrectedCalibration,
    OnlineCorrection,
    SequentialTemperatureScaling,
    reliability_diagram,
    scale_temperature,
)
from dspark_hf.decoding.verification import Scheduler
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


def test_default_grid_is_geometric_from_a_tenth_to_ten():
    assert len(DEFAULT_GRID) == 201 and DEFAULT_GRID[100] == 1.0
    assert DEFAULT_GRID[0] == pytest.approx(0.1, rel=1e-12) and DEFAULT_GRID[-1] == pytest.approx(10.0, rel=1e-12)
    assert DEFAULT_GRID[1] / DEFAULT_GRID[0] == pytest.approx(10 ** 0.01, rel=1e-12)


def test_fit_picks_the_grid_temperature_of_least_ece_left_to_right():
    """The STS search against a plain loop over the grid (paper §3.2.1): T[k] minimises the ECE of
    a'[k] = a'[k-1] · sigmoid(logit(c[k]) / T) with T[1..k-1] already chosen; ties go to the first entry."""
    c, accepted = synthetic_rounds(n=400, gamma=3, seed=3)
    grid = [0.5, 1.0, 2.0, 3.0, 4.0]
    labels = (accepted[:, None] >= torch.arange(1, 4)).long()
    survival, expected = torch.ones(400, dtype=torch.float64), []
    for k in range(3):
        eces = [expected_calibration_error(survival * torch.sigmoid(torch.logit(c[:, k]) / t), labels[:, k], 15)
                for t in grid]
        best = min(range(len(grid)), key=lambda i: (eces[i], i))
        expected.append(grid[best])
        survival = survival * torch.sigmoid(torch.logit(c[:, k]) / grid[best])
    assert len(set(expected)) > 1  # the positions do not all pick one temperature
    assert SequentialTemperatureScaling().fit(c, accepted, grid=grid).temperatures == expected


def test_apply_converts_integers_and_covers_one_position(fitted):
    sts = fitted[0]
    out = sts.apply(torch.tensor([1, 0]))  # integer probabilities become float64; 0 and 1 stay put
    assert out.dtype == torch.float64 and out.tolist() == [1.0, 0.0]
    c = torch.tensor([[0.3], [0.7]], dtype=torch.float64)
    torch.testing.assert_close(sts.apply(c), scale_temperature(c, sts.temperatures[0]))  # γ = 1
    with pytest.raises(ValueError, match="γ = 0"):
        sts.apply(torch.tensor(0.5))


def test_report_by_hand():
    # T = 1: calibrated = raw. n = 2, 0, 1; conditional rounds: all 3 for k = 1, the two with n >= 1 for k = 2
    c = torch.tensor([[0.8, 0.5], [0.6, 1.0], [0.3, 0.9]], dtype=torch.float64)
    report = SequentialTemperatureScaling([1.0, 1.0]).report(c, torch.tensor([2, 0, 1]))
    assert report["n_rounds"] == 3 and report["mean_ece_before"] == report["mean_ece_after"]
    positions = report["positions"]
    assert [p["position"] for p in positions] == [1, 2] and [p["temperature"] for p in positions] == [1.0, 1.0]
    assert [p["n_conditional"] for p in positions] == [3, 2]
    assert [p["survival_rate"] for p in positions] == pytest.approx([2 / 3, 1 / 3])
    # k = 1: positives 0.8, 0.3 vs negative 0.6 -> 1 of 2 pairs; k = 2: positive 0.5 vs negative 0.9 -> 0
    assert [p["roc_auc"] for p in positions] == [0.5, 0.0]


def test_saved_json_is_indented_by_two(fitted, tmp_path):
    text = fitted[0].save(tmp_path / "c.json").read_text()
    assert text.startswith('{\n  "format_version": 1,\n  "temperatures": [\n    ') and text.endswith("}\n")


class _Axes:
    """Records the drawing calls of one matplotlib Axes."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_reliability_panel_draws_the_bin_means_and_the_diagonal():
    # 4 bins: raw 0.1, 0.2 | 0.9 (bins 1 and 2 empty, not drawn); STS 0.3, 0.3 | 0.6
    y = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
    raw, sts = torch.tensor([[0.1], [0.2], [0.9]], dtype=torch.float64), torch.tensor([[0.3], [0.3], [0.6]], dtype=torch.float64)
    ax = _Axes()
    calibration._reliability_panel(ax, "position 1", raw, sts, y, 4)
    (_, diagonal, style), (_, raw_xy, raw_kw), (_, sts_xy, sts_kw), (_, _, axes), _ = ax.calls
    assert diagonal == ([0, 1], [0, 1]) and style == {"color": "grey", "linestyle": ":", "linewidth": 1}
    assert [v for t in raw_xy for v in t.tolist()] == pytest.approx([0.15, 0.9, 0.5, 1.0])  # x then y
    assert [v for t in sts_xy for v in t.tolist()] == pytest.approx([0.3, 0.6, 0.5, 1.0])
    # ECE = 2/3 · |0.15 - 0.5| + 1/3 · |0.9 - 1| = 0.2667 and 2/3 · 0.2 + 1/3 · 0.4 = 0.2667
    assert raw_kw == {"marker": "o", "markersize": 3, "label": "raw (ECE 26.7%)"}
    assert sts_kw["label"] == "STS (ECE 26.7%)"
    assert axes["xlim"] == (0, 1) and axes["ylim"] == (0, 1) and axes["title"] == "position 1"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_reliability_diagram_lays_out_four_panels_a_row(fitted, tmp_path, monkeypatch):
    sts, c, accepted = fitted
    c5, sts5 = torch.cat([c, c[:, :1]], 1)[:100], SequentialTemperatureScaling([*sts.temperatures, 1.0])
    panels = []
    draw = calibration._reliability_panel
    monkeypatch.setattr(calibration, "_reliability_panel", lambda ax, title, before, *rest: (
        panels.append((title, before, rest[-1])), draw(ax, title, before, *rest)))
    out = reliability_diagram(c5, accepted[:100], sts5, tmp_path / "five.png")
    assert _png_size(out) == (4 * 384, 2 * 384)  # 3.2 in a panel at 120 dpi; γ = 5 panels in 2 rows of 4
    assert [(title, bins) for title, _, bins in panels] == [(f"position {k}", 15) for k in range(1, 6)]  # 15 by default
    survival = torch.cumprod(c5, 1)  # (N, 5)
    for k, (_, before, _) in enumerate(panels):
        torch.testing.assert_close(before, survival[:, k : k + 1])  # position k + 1's raw a_k, (N, 1)
    assert _png_size(reliability_diagram(c[:50], accepted[:50], sts, tmp_path / "pooled.png", pooled=True)) == (384, 384)


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
        (lambda sts: sts.fit(torch.rand(3, 2), torch.tensor([0, 1, 1]), grid=[0.0, 1.0]), "grid"),
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
    values = [0.5, 0.9, 0.123, 0.0]
    assert correction.apply(values) == correction.apply(torch.tensor(values, dtype=torch.float64)).tolist()  # a list
    with pytest.raises(ValueError, match="accepted must be in 0..2"):
        correction.observe([0.5, 0.5], 3)
    with pytest.raises(ValueError, match="prior must be > 0"):
        OnlineCorrection(prior=0)
    small = OnlineCorrection(prior=0.5)  # any positive pseudo-count is allowed
    small.observe([0.5], 1)
    assert small.factor == pytest.approx(1.5 / 1.0)


def test_a_hybrid_rounds_forced_lookup_tokens_do_not_teach_the_correction():
    """Block [0.5, 0.8, 0.6, 0.4] (calibrated), its first k drafts forced lookup tokens: only the drafter's own verified
    drafts k+1..ℓ count, and only once the k forced were all accepted."""
    correction = OnlineCorrection(prior=2.0)
    correction.observe_round([0.5, 0.8, 0.6, 0.4], 1, 3, 2)  # drafts 2, 3 verified; the lookup token and draft 2 accepted
    assert (correction.expected, correction.accepted) == (pytest.approx(0.8 + 0.6), 1)
    correction.observe_round([0.5, 0.8, 0.6, 0.4], 2, 4, 1)  # a forced token rejected: the drafter was not reached
    correction.observe_round([0.5, 0.8, 0.6, 0.4], 2, 2, 2)  # a lookup-only prefix verified: none of the drafter's
    assert (correction.expected, correction.accepted) == (pytest.approx(1.4), 1)
    correction.observe_round([0.5, 0.8, 0.6, 0.4], 0, 2, 0)  # a DSpark round: observe's rule (position 1 reached)
    assert (correction.expected, correction.accepted) == (pytest.approx(1.9), 1)


def test_failing_drafts_halve_the_estimates_within_a_few_rounds():
    """Calibrated c_1 = 0.6, always rejected, with the default prior (m = 1): f = 1 / 1.6 after one round and
    1 / 2.2 (< 0.5) after two."""
    correction = OnlineCorrection()
    factors = []
    for _ in range(2):
        correction.observe([0.6, 0.6, 0.6], 0)
        factors.append(correction.factor)
    assert factors == pytest.approx([1 / 1.6, 1 / 2.2]) and factors[-1] < 0.5


def test_the_scheduler_plans_on_the_corrected_confidences():
    """Identity STS (T = 1), c = [0.8, 0.8], SPS = 10 / 8 / 7 steps/s for B = 1 / 2 / 3. Uncorrected: Θ = 10, 14.4,
    17.08, so ℓ = 2. After drafts worth 2 expected acceptances failed (f = 2 / 4): c'' = 0.4, Θ = 10, 11.2, 10.92,
    so ℓ = 1; after 6 (f = 2 / 8): c'' = 0.2, Θ(1) = 9.6 < 10, so ℓ = 0 (the round verifies the target's token)."""
    sts, correction, sps = SequentialTemperatureScaling([1.0, 1.0]), OnlineCorrection(prior=2.0), [10.0, 8.0, 7.0]
    confidences = torch.tensor([0.8, 0.8])
    lengths = []
    for failures in (0, 2, 4):
        for _ in range(failures):
            correction.observe([1.0], 0)
        lengths.append(Scheduler().prefix_length(confidences, CorrectedCalibration(sts, correction), sps, 2, 0.0))
    assert lengths == [2, 1, 0]
    assert CorrectedCalibration(sts, correction).apply(confidences).tolist() == pytest.approx([0.2, 0.2])
