"""dspark_hf.metrics (the one home of τ, conditional acceptance, ECE / Brier / ROC-AUC): scikit-learn
cross-checks, and the `evaluate` modules under evaluate_metrics/ loaded offline against the bench on recorded rounds.

`evaluate` and scikit-learn are test-only extras (`pip install -e '.[dev]'`); without them these tests skip.
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CYCLE_VOCAB, cycle_drafter, cycle_target
from test_calibration import synthetic_rounds

from dspark_hf import SequentialTemperatureScaling
from dspark_hf.bench import runner as bench
from dspark_hf.decoding.stats import full_rounds
from dspark_hf.metrics import (
    brier_score,
    conditional_acceptance,
    conditional_mask,
    expected_calibration_error,
    prefix_survival_metrics,
    roc_auc,
    survival_labels,
    tau,
)

METRICS = Path(__file__).resolve().parent.parent / "evaluate_metrics"
GAMMA = 4

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------- hand values
def test_tau_and_conditional_acceptance_by_hand():
    assert tau([0, 3, 7]) == pytest.approx(13 / 3) and tau([]) is None
    # n = 0, 2, 2, 1: 3 of 4 rounds reach n >= 1, 2 of those 3 reach n >= 2, no round reaches 3
    assert conditional_acceptance([0, 2, 2, 1], 3) == pytest.approx([3 / 4, 2 / 3, 0.0])
    assert conditional_acceptance([0, 0], 2) == [0.0, None]  # position 2: no round reached it


def test_survival_labels_and_conditional_mask_by_hand():
    accepted = torch.tensor([0, 1, 2])
    assert survival_labels(accepted, 2).tolist() == [[0, 0], [1, 0], [1, 1]]  # 1[n >= k]
    assert conditional_mask(accepted, 2).tolist() == [[True, False], [True, True], [True, True]]  # n >= k - 1


def test_default_bins_are_fifteen():
    # 0.0 and 0.064 share bin [0, 1/15) but not [0, 1/16): one bin gives |0.032 - 0.5|, two give (0.064 + 1) / 2
    probs, labels = torch.tensor([0.064, 0.0], dtype=torch.float64), torch.tensor([0, 1])
    assert expected_calibration_error(probs, labels) == pytest.approx(0.468, abs=1e-12)
    assert expected_calibration_error(probs, labels, 16) == pytest.approx(0.532, abs=1e-12)
    assert prefix_survival_metrics(probs[:, None], torch.tensor([0, 1]))["ece"] == pytest.approx(0.468, abs=1e-12)


def test_single_sample_and_single_class():
    assert expected_calibration_error(torch.tensor([0.3]), torch.tensor([1])) == pytest.approx(0.7)
    assert math.isnan(roc_auc(torch.tensor([0.3]), torch.tensor([1])))  # one class: undefined, not an error
    assert roc_auc(torch.tensor([0.9, 0.2, 0.4]), torch.tensor([1, 0, 0])) == 1.0  # one positive is enough


def test_prefix_survival_metrics_by_hand():
    # a = cumprod(c) = [[0.8, 0.4, 0.2], [0.6, 0.6, 0.3]]; labels 1[n >= k] with n = 2, 0: [[1, 1, 0], [0, 0, 0]]
    c = torch.tensor([[0.8, 0.5, 0.5], [0.6, 1.0, 0.5]], dtype=torch.float64)
    result = prefix_survival_metrics(c, torch.tensor([2, 0]), n_bins=1)  # one bin: ECE = |mean a - mean y|
    assert [p["position"] for p in result["positions"]] == [1, 2, 3]
    assert [p["survival_rate"] for p in result["positions"]] == [0.5, 0.5, 0.0]
    assert [p["ece"] for p in result["positions"]] == pytest.approx([0.2, 0.0, 0.25], abs=1e-12)
    assert [p["brier"] for p in result["positions"]] == pytest.approx([0.2, 0.36, 0.065], abs=1e-12)
    assert [p["roc_auc"] for p in result["positions"]] == [1.0, 0.0, None]  # position 3: no survivor
    assert result["n_rounds"] == 2 and result["roc_auc"] == 0.5  # mean over the positions where it is defined
    assert result["ece"] == pytest.approx(0.45 / 3, abs=1e-12) and result["brier"] == pytest.approx(0.625 / 3, abs=1e-12)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: prefix_survival_metrics(torch.rand(3, 2), torch.tensor([True, False, True])), "integer"),
    (lambda: prefix_survival_metrics(torch.rand(3, 2), torch.tensor([0, 1])), r"shape \(3,\)"),
    (lambda: prefix_survival_metrics(torch.rand(3, 2), torch.tensor([0, 1, 1]), n_bins=0), "n_bins"),
    (lambda: roc_auc(torch.rand(2, 2), torch.tensor([0, 1])), r"shape \(N,\)"),
    (lambda: roc_auc(torch.tensor([]), torch.tensor([])), r"shape \(N,\)"),
    (lambda: brier_score(torch.tensor([0.5, -0.1]), torch.tensor([0, 1])), r"\[0, 1\]"),
])
def test_metric_inputs_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------- scikit-learn
def sklearn_ece(probs: np.ndarray, labels: np.ndarray, n_bins: int) -> float:
    """ECE from scikit-learn's reliability curve: sum over non-empty bins of (n_b / N) |rate_b - mean p_b|."""
    from sklearn.calibration import calibration_curve

    rate, mean_p = calibration_curve(labels, probs, n_bins=n_bins, strategy="uniform")
    counts = np.histogram(probs, bins=np.linspace(0, 1, n_bins + 1))[0]
    counts = counts[counts > 0]  # calibration_curve drops empty bins, in the same order
    return float(np.sum(counts / len(probs) * np.abs(rate - mean_p)))


@pytest.fixture(scope="module")
def sample():
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(3000, generator=g, dtype=torch.float64)  # continuous: no value on a bin edge
    labels = (torch.rand(3000, generator=g, dtype=torch.float64) < probs ** 1.5).long()  # miscalibrated on purpose
    return probs, labels


@pytest.mark.parametrize("n_bins", [1, 5, 15])
def test_ece_matches_sklearn(sample, n_bins):
    pytest.importorskip("sklearn")
    probs, labels = sample
    ours = expected_calibration_error(probs, labels, n_bins)
    assert ours > 0.01  # miscalibrated: the comparison is not 0 == 0
    assert ours == pytest.approx(sklearn_ece(probs.numpy(), labels.numpy(), n_bins), abs=1e-12)


def test_brier_and_auc_match_sklearn(sample):
    metrics = pytest.importorskip("sklearn.metrics")
    probs, labels = sample
    assert brier_score(probs, labels) == pytest.approx(metrics.brier_score_loss(labels.numpy(), probs.numpy()), abs=1e-12)
    assert roc_auc(probs, labels) == pytest.approx(metrics.roc_auc_score(labels.numpy(), probs.numpy()), abs=1e-12)
    tied = torch.round(probs * 10) / 10  # 11 distinct scores: ties everywhere
    assert roc_auc(tied, labels) == pytest.approx(metrics.roc_auc_score(labels.numpy(), tied.numpy()), abs=1e-12)


def test_prefix_survival_matches_sklearn_per_position():
    metrics = pytest.importorskip("sklearn.metrics")
    c, accepted = synthetic_rounds(n=1500, gamma=GAMMA, seed=2)
    result = prefix_survival_metrics(c, accepted, n_bins=10)
    a = torch.cumprod(c, 1).numpy()
    for k, position in enumerate(result["positions"]):
        y = (accepted.numpy() >= k + 1).astype(int)
        assert position["survival_rate"] == pytest.approx(y.mean())
        assert position["ece"] == pytest.approx(sklearn_ece(a[:, k], y, 10), abs=1e-12)
        assert position["brier"] == pytest.approx(metrics.brier_score_loss(y, a[:, k]), abs=1e-12)
        assert position["roc_auc"] == pytest.approx(metrics.roc_auc_score(y, a[:, k]), abs=1e-12)
    assert result["ece"] == pytest.approx(np.mean([p["ece"] for p in result["positions"]]))


# -------------------------------------------------------------------------------- evaluate
@pytest.fixture(scope="module")
def recorded():
    """Fixed-length greedy rounds of the cycle drafter on a few prompts: (stats list, accepted, confidences)."""
    target = cycle_target(num_hidden_layers=1, alpha=0.026)
    drafter = cycle_drafter(target, "markov", block_size=GAMMA)
    g = torch.Generator().manual_seed(7)
    stats = []
    for _ in range(4):
        ids = torch.randint(CYCLE_VOCAB, (1, 5), generator=g)
        target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=48,
                        do_sample=False, dspark_verification="fixed")
        stats.append(drafter.last_stats)
    accepted, confidences = full_rounds(stats, GAMMA)
    assert len(accepted) >= 20 and len(set(accepted)) >= 3  # a mix of short and long acceptances
    return stats, accepted, confidences


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    evaluate = pytest.importorskip("evaluate")
    modules = tmp_path_factory.mktemp("evaluate_modules")
    evaluate.config.HF_MODULES_CACHE = modules  # keep the copied module scripts out of the user's cache

    def load(name):
        return evaluate.load(str(METRICS / name))

    return load


def test_evaluate_tau_equals_the_bench_and_generation_stats(load, recorded):
    stats, accepted, _ = recorded
    metric = load("dspark_tau")
    assert metric.compute(accepted=accepted)["tau"] == pytest.approx(bench.tau(accepted))
    assert metric.compute(accepted=[r.accepted for r in stats[0].rounds])["tau"] == pytest.approx(stats[0].tau)
    assert metric.compute(accepted=[0, 3, 7])["tau"] == pytest.approx(13 / 3)


def test_evaluate_conditional_acceptance_equals_the_bench(load, recorded):
    _, accepted, _ = recorded
    metric = load("dspark_conditional_acceptance")
    expected = bench.conditional_acceptance(accepted, GAMMA)
    assert metric.compute(accepted=accepted, gamma=GAMMA)["conditional_acceptance"] == pytest.approx(expected)
    assert metric.compute(accepted=[0, 2, 2, 1], gamma=2)["conditional_acceptance"] == pytest.approx([3 / 4, 2 / 3])


def test_evaluate_prefix_survival_equals_the_bench_calibration_tables(load, recorded):
    _, accepted, confidences = recorded
    metric = load("dspark_prefix_survival")
    sts = SequentialTemperatureScaling(temperatures=[1.5, 0.8, 1.2, 1.0])
    summary = bench.confidence_summary(confidences, accepted, sts)  # what the bench report shows
    raw = metric.compute(confidences=confidences, accepted=accepted)
    calibrated = metric.compute(confidences=sts.apply(torch.tensor(confidences, dtype=torch.float64)).tolist(),
                                accepted=accepted)
    assert raw["n_rounds"] == summary["rounds"] == len(accepted)
    assert raw["ece"] == pytest.approx(summary["mean_ece_before"])
    assert calibrated["ece"] == pytest.approx(summary["mean_ece_after"])
    for ours, theirs in zip(raw["positions"], summary["positions"]):
        assert ours["ece"] == pytest.approx(theirs["ece_before"]) and ours["survival_rate"] == theirs["survival_rate"]
    assert raw["ece"] != pytest.approx(calibrated["ece"])  # the temperatures changed something
    # both sides above call prefix_survival_metrics; the values themselves, from scikit-learn on a = cumprod(c)
    # against 1[n >= k] (paper §3.2.1), so a wrong ECE in the one shared function shows here
    pytest.importorskip("sklearn")
    labels = (np.array(accepted)[:, None] >= np.arange(1, GAMMA + 1)).astype(int)  # (N, γ)
    calibrated_c = sts.apply(torch.tensor(confidences, dtype=torch.float64)).numpy()
    for result, c in ((raw, np.array(confidences)), (calibrated, calibrated_c)):
        survival = np.cumprod(c, axis=1)  # (N, γ)
        eces = [sklearn_ece(survival[:, k], labels[:, k], 15) for k in range(GAMMA)]
        assert [p["ece"] for p in result["positions"]] == pytest.approx(eces, abs=1e-12)
        assert result["ece"] == pytest.approx(np.mean(eces), abs=1e-12)
        assert [p["survival_rate"] for p in result["positions"]] == pytest.approx(labels.mean(axis=0).tolist())
