"""dspark_hf.metrics (the one home of τ, conditional acceptance, ECE / Brier / ROC-AUC): scikit-learn
cross-checks, and the `evaluate` modules under evaluate_metrics/ loaded offline against the bench on recorded rounds.

`evaluate` and scikit-learn are test-only extras (`pip install -e '.[dev]'`); without them these tests skip.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CYCLE_VOCAB, cycle_drafter, cycle_target
from test_calibration import synthetic_rounds

from dspark_hf import SequentialTemperatureScaling
from dspark_hf.bench import runner as bench
from dspark_hf.decoding.stats import full_rounds
from dspark_hf.metrics import brier_score, expected_calibration_error, prefix_survival_metrics, roc_auc

METRICS = Path(__file__).resolve().parent.parent / "evaluate_metrics"
GAMMA = 4

pytestmark = pytest.mark.usefixtures("one_thread")


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
