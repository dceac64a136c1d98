"""Tests for the hardware-aware prefix scheduler (paper §3.2.2, Algorithm 1, Appendix A)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_hf.decoding.scheduler import (
    expected_throughputs,
    prefix_survival,
    schedule_batch,
    schedule_global,
    schedule_prefix,
    threshold_prefix,
)

# Worked example for R = 2: SPS(1..8); SPS(1) is never read because B starts at R = 2.
WORKED_SPS = [1.0, 1.0, 0.95, 0.9, 0.85, 0.5, 0.45, 0.4]
WORKED_C = [[0.9, 0.6, 0.2], [0.8, 0.5, 0.1]]
APPENDIX_SPS = [1.0, 0.5, 0.45]


def test_prefix_survival_matches_worked_example():
    a = prefix_survival(torch.tensor(WORKED_C, dtype=torch.float64))
    expected = torch.tensor([[0.9, 0.54, 0.108], [0.8, 0.4, 0.04]], dtype=torch.float64)
    torch.testing.assert_close(a, expected)
    assert prefix_survival([0.5, 0.5]).tolist() == [0.5, 0.25]


def test_schedule_batch_worked_example():
    lengths = schedule_batch(WORKED_C, WORKED_SPS)
    assert lengths == [2, 1]
    assert sum(1 + ell for ell in lengths) == 5  # B


@pytest.mark.parametrize(("c2", "global_choice"), [(0.0, 0), (0.3, 0), (0.9, 2), (1.0, 2)])
def test_appendix_a_early_stop_ignores_second_confidence(c2, global_choice):
    # Θ0 = 1.0 > Θ1 = 0.9 stops before c2 is read, whatever c2 is.
    assert schedule_global([0.8, c2], APPENDIX_SPS) == global_choice
    assert schedule_prefix([0.8, c2], APPENDIX_SPS) == 0
    assert schedule_batch([[0.8, c2]], APPENDIX_SPS) == [0]


# SPS(1..8) measured on the 2-core CPU of docs/benchmarks.json: verifying 2-3 tokens is slower than 8.
CPU_SPS = [15.5, 8.0, 7.0, 9.7, 9.3, 8.3, 6.7, 11.4]


def test_global_search_crosses_an_sps_cliff():
    c = [0.6] * 7  # a = 0.6, 0.36, 0.216, ...: τ(7) = 2.459
    assert schedule_prefix(c, CPU_SPS) == 0  # Θ(1) = 1.6 · 8.0 = 12.8 <= Θ(0) = 15.5: early stop
    assert schedule_global(c, CPU_SPS) == 7  # Θ(7) = 2.459 · 11.4 = 28.0 is the maximum
    assert schedule_global([0.1] * 7, CPU_SPS) == 0  # Θ(7) = 1.111 · 11.4 = 12.7 < 15.5
    assert schedule_global([1.0, 0.0, 0.5], [1.0, 1.0, 1.0, 1.0]) == 1  # ties go to the shorter prefix


def test_flat_sps_admits_every_positive_survival():
    flat = [1.0] * 10
    assert schedule_prefix([0.9, 0.1, 0.5], flat) == 3
    assert schedule_prefix([0.9, 0.0, 0.5], flat) == 1
    assert schedule_batch([[0.9, 0.1], [0.2, 0.0]], flat) == [2, 1]


def test_length_limited_by_sps_table():
    assert schedule_prefix([1.0] * 5, [1.0, 1.0, 1.0]) == 2
    # Equal survival probabilities keep request-then-position order (stable sort).
    assert schedule_batch([[1.0] * 5, [1.0] * 5], [1.0] * 4) == [2, 0]


def test_expected_throughputs_by_hand():
    # a = 0.5, 0.25: Θ(0) = 1 · 1.0, Θ(1) = 1.5 · 0.8, Θ(2) = 1.75 · 0.6 (τ counts the bonus token: 1 + Σ a)
    assert expected_throughputs([0.5, 0.5], [1.0, 0.8, 0.6]) == pytest.approx([1.0, 1.2, 1.05], abs=1e-12)
    assert expected_throughputs([0.5, 0.5], [2.0, 1.0]) == pytest.approx([2.0, 1.5], abs=1e-12)  # ℓ <= len(sps) - 1


def test_a_list_of_floats_gives_what_its_tensor_gives():
    # the planner's lists skip the tensor checks: the same floats as a float64 tensor, and invalid lists still raise
    g = torch.Generator().manual_seed(0)
    sps = [1000.0 / m for m in (65, 70, 74, 80, 85, 91, 96, 100)]
    for _ in range(50):
        c = torch.rand(7, generator=g, dtype=torch.float64)
        assert expected_throughputs(c.tolist(), sps) == expected_throughputs(c, sps)
    assert expected_throughputs([1, 0], sps) == expected_throughputs([1.0, 0.0], sps)  # ints: through the tensor path
    for bad in ([1.5], [float("nan")], [-0.1, 0.5]):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            expected_throughputs(bad, sps)
    with pytest.raises(ValueError, match="shape"):
        expected_throughputs([], sps)


def test_a_tie_is_not_an_improvement():
    # Θ(1) = (1 + 0.5) · 1.0 = 1.5 = Θ(0) = 1 · 1.5 exactly: Algorithm 1 admits only a strict gain
    assert schedule_prefix([0.5], [1.5, 1.0]) == 0
    assert schedule_batch([[0.5]], [1.5, 1.0]) == [0]
    assert schedule_batch([[0.5]], [1.5, 1.0], early_stop=False) == [0]


def test_accepts_tensors():
    assert schedule_prefix(torch.tensor([0.9, 0.6, 0.2]), WORKED_SPS) == schedule_prefix([0.9, 0.6, 0.2], WORKED_SPS)


confidence_vectors = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6)
sps_curves = st.lists(st.floats(0.01, 10.0), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(confidence_vectors, sps_curves)
def test_single_request_batch_equals_schedule_prefix(c, sps):
    assert schedule_batch([c], sps) == [schedule_prefix(c, sps)]


@pytest.mark.parametrize(
    ("c", "threshold", "expected"),
    [([0.9, 0.6, 0.2], 0.5, 2), ([0.9, 0.6, 0.2], 0.95, 0), ([0.9, 0.6, 0.2], 0.0, 3), ([0.4, 0.9], 0.4, 2),
     ([1.0, 0.9], 1.0, 1)],  # threshold 1 is a valid probability: only certain drafts pass
)
def test_threshold_prefix(c, threshold, expected):
    assert threshold_prefix(c, threshold) == expected


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: prefix_survival([]), "γ >= 1"),
        (lambda: prefix_survival([0.5, 1.5]), r"\[0, 1\]"),
        (lambda: prefix_survival([float("nan")]), "NaN"),
        (lambda: schedule_prefix([0.5], []), "sps is empty"),
        (lambda: schedule_prefix([0.5], [1.0, 0.0]), "> 0"),
        (lambda: schedule_prefix([[0.5]], [1.0]), r"shape \(γ,\)"),
        (lambda: schedule_prefix([-0.1], [1.0]), r"\[0, 1\]"),
        (lambda: schedule_batch([], [1.0]), "empty"),
        (lambda: schedule_batch([[0.5], [0.5]], [1.0]), "max_tokens"),
        (lambda: threshold_prefix([0.5], 1.5), "threshold"),
        (lambda: threshold_prefix([], 0.5), "γ >= 1"),
    ],
)
def test_bad_input_raises(call, message):
    with pytest.raises(ValueError, match=message):
        call()
