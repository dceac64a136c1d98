"""Prompt lookup inside the DSpark round (dspark_hf.decoding.lookup, issue #14): matching, the acceptance estimate, the
Θ-based choice, one-hot proposals and drafting conditioned on forced lookup tokens. Generation-level tests
(greedy identity, exact sampling, the choice never depending on the round's drafts) are in test_generation.py."""

import pytest
import torch
from conftest import CYCLE, cycle_drafter, cycle_target, tiny_sps_curve

from dspark_hf import SequentialTemperatureScaling
from dspark_hf.decoding.batch_costs import MAX_PROBE_INTERVAL, PROBE_LOSS_BOUND
from dspark_hf.decoding.calibration import OnlineCorrection
from dspark_hf.decoding.lookup import (
    REFRESH_ROUNDS,
    LookupDrafting,
    LookupMatch,
    find_continuation,
    lookup_enabled,
    one_hot_logits,
    plan_round,
)
from dspark_hf.decoding.lookup_acceptance import LookupAcceptance, LookupPrior, lookup_prior, reset_lookup_prior
from dspark_hf.decoding.scheduler import expected_throughputs

pytestmark = pytest.mark.usefixtures("one_thread")

SPS = [1000.0 / m for m in (65, 109, 110, 115, 120, 126, 130, 135, 140)]  # steep then flat (CPU-like), B = 1..9


# ------------------------------------------------------------------------------------- matching
def test_longest_match_wins_over_a_more_recent_shorter_one():
    #        0  1  2  3  4  5  6  7  8  9
    ids = [7, 1, 2, 3, 9, 2, 3, 5, 1, 2]  # suffix [1, 2]: at 1-2 (n = 2); [2] alone also at 5 (more recent)
    assert find_continuation(ids, 3) == LookupMatch((3, 9, 2), 2)


def test_most_recent_full_continuation_else_the_earliest():
    ids = [4, 5, 6, 4, 5, 8, 4]  # anchor 4 at 0 and 3, each a 1-gram match
    assert find_continuation(ids, 3) == LookupMatch((5, 8, 4), 1)  # most recent with 3 tokens after it
    assert find_continuation(ids, 4) == LookupMatch((5, 6, 4, 5), 1)  # only position 0 has 4: the earliest
    assert find_continuation([4, 5, 4], 4) == LookupMatch((5, 4), 1)  # none has 4: the longest there is


def test_repeating_pattern_continues_itself_and_match_length_is_capped():
    ids = [3, 8] * 6
    match = find_continuation(ids, 4, max_ngram=5)
    assert match == LookupMatch((3, 8, 3, 8), 5)
    assert find_continuation([5, 5, 5, 5], 3) == LookupMatch((5,), 3)  # overlapping: continuation is the anchor


def test_no_match():
    assert find_continuation([1, 2, 3], 3) is None  # the anchor never occurred before
    assert find_continuation([3], 3) is None
    assert find_continuation([1, 2, 1], 0) is None
    assert find_continuation(torch.tensor([[1, 2, 1]]), 2) == LookupMatch((2, 1), 1)  # (1, L) tensors work too


def _vectorised_continuation(ids, max_tokens, max_ngram=8):
    """The matcher as it was written with tensor ops (issue #14), the reference the plain-Python one must equal."""
    seq = torch.as_tensor(ids).reshape(-1)
    n_ids = seq.numel()
    if n_ids < 2 or max_tokens <= 0:
        return None
    alive = seq[:-1] == seq[-1]
    length = torch.zeros(n_ids - 1, dtype=torch.long)
    for k in range(min(max_ngram, n_ids - 1)):
        if k > 0:
            extends = torch.zeros(n_ids - 1, dtype=torch.bool)
            extends[k:] = seq[: n_ids - 1 - k] == seq[n_ids - 1 - k]
            alive &= extends
        length += alive
    best = int(length.max())
    if best == 0:
        return None
    ends = (length == best).nonzero().flatten()
    full = ends[ends + max_tokens <= n_ids - 1]
    p = int(full[-1]) if full.numel() else int(ends[0])
    return LookupMatch(tuple(seq[p + 1: p + 1 + max_tokens].tolist()), best)


def test_matching_equals_the_vectorised_reference():
    g = torch.Generator().manual_seed(0)
    for trial in range(400):  # small vocabularies: many matches, ties and long ones
        vocab = (2, 3, 5, 50)[trial % 4]
        ids = torch.randint(0, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        for max_tokens, max_ngram in ((1, 8), (4, 8), (7, 3), (16, 1), (3, 20)):
            expected = _vectorised_continuation(ids, max_tokens, max_ngram)
            assert find_continuation(ids, max_tokens, max_ngram) == expected, (ids, max_tokens, max_ngram)
            assert find_continuation(torch.tensor([ids]), max_tokens, max_ngram) == expected


# -------------------------------------------------------------------------------- the estimate
def test_acceptance_counts_by_effective_match_length():
    est = LookupAcceptance(max_ngram=4)
    match = LookupMatch((10, 11, 12, 13), 2)  # buckets 2, 3, 4, 4 (capped)
    assert est.conditionals(match) == [0.5] * 4  # Beta(1, 1) prior
    est.update(match, [10, 11, 99])  # 2 accepted (buckets 2, 3), rejected at bucket 4
    assert (est.accepted, est.rejected) == ([0, 0, 1, 1, 0], [0, 0, 0, 0, 1])
    est.update(match, [10])  # only one token produced: position 2 unseen
    assert est.accepted == [0, 0, 2, 1, 0]
    # priors pooled apart (s·p, s = 2): first tokens 2 accepted of 2 -> 2·3/4; later ones 1 of 2 -> 2·2/4
    assert est.conditionals(match) == pytest.approx([(2 + 1.5) / 4, (1 + 1) / 3, (0 + 1) / 3, (0 + 1) / 3])
    est.update(LookupMatch((5,), 1), [6, 7])  # a first token rejected: first-token pool 2 of 3
    assert est.rejected[1] == 1
    assert est.conditionals(LookupMatch((5, 6), 1)) == pytest.approx([(0 + 2 * 3 / 5) / 3, (2 + 1) / 4])


def test_a_prompt_whose_lookups_fail_stops_trusting_new_lengths():
    """A length never seen starts from the generation's pooled first-token rate, not from 1/2."""
    est = LookupAcceptance(max_ngram=8)
    for n in range(1, 7):  # six first tokens rejected, each at another match length
        est.update(LookupMatch((1, 2), n), [9])
    fresh = est.conditionals(LookupMatch((1, 2), 7))[0]
    assert fresh == pytest.approx(2 * (0 + 1) / (6 + 2) / 2)  # (0 + s·p) / (0 + s), p = 1/8


def first_call_counts(prior):
    """A call's verified lookups: first tokens 2 accepted and 3 rejected, later tokens 0 accepted and 2 rejected."""
    est = LookupAcceptance(prior=prior)
    for _ in range(2):
        est.update(LookupMatch((5, 6), 1), [5, 9])  # first accepted, second rejected
    for _ in range(3):
        est.update(LookupMatch((5,), 2), [8])  # first rejected
    assert est.pooled == {True: [2, 3], False: [0, 2]}
    return est


def test_a_second_call_starts_from_the_first_calls_pooled_acceptance():
    """Issue #28: the prior is learnt across calls: p₀ = (A + α) / (A + R + α + β) per kind, Beta(1, 1)."""
    prior = LookupPrior()
    first = first_call_counts(prior)
    assert first.prior_means == {True: 0.5, False: 0.5}  # nothing learnt before it
    second = LookupAcceptance(prior=prior)
    assert second.prior_means == pytest.approx({True: (2 + 1) / (5 + 2), False: (0 + 1) / (2 + 2)})
    # the second call's first conditionals: unseen buckets 4, 5 read p₀ of their kind
    assert second.conditionals(LookupMatch((1, 2), 4)) == pytest.approx([3 / 7, 1 / 4])
    second.update(LookupMatch((1,), 3), [2])  # its own first token rejected: p = (0 + s·p₀) / (1 + s)
    assert second.conditionals(LookupMatch((1,), 5)) == pytest.approx([(0 + 2 * 3 / 7) / 3])
    # the first call's counts are live: what it verified after the second call started does not reach the second
    first.update(LookupMatch((5,), 2), [5])
    assert second.prior_means[True] == pytest.approx(3 / 7)
    assert LookupAcceptance(prior=prior).prior_means[True] == pytest.approx((3 + 0 + 1) / (6 + 1 + 2))


def test_one_call_weighs_at_most_the_cap_and_the_window_forgets():
    prior = LookupPrior(window=2, cap=16)
    long = LookupAcceptance(prior=prior)
    for _ in range(40):  # 40 first tokens rejected: weighs 16
        long.update(LookupMatch((5,), 1), [8])
    short = LookupAcceptance(prior=prior)
    for _ in range(2):
        short.update(LookupMatch((5,), 1), [5])
    assert prior.means()[True] == pytest.approx((0 + 2 + 1) / (16 + 2 + 2))
    LookupAcceptance(prior=prior)  # a third call: the window of 2 forgets the long one
    assert prior.means()[True] == pytest.approx((2 + 1) / (2 + 2))
    prior.reset()
    assert LookupAcceptance(prior=prior).prior_means == {True: 0.5, False: 0.5}


def test_the_drafters_prior_is_shared_by_its_calls_greedy_and_sampled_apart():
    drafter = torch.nn.Linear(1, 1)  # any weak-referenceable object stands for a drafter
    greedy = lookup_prior(drafter, False)
    assert lookup_prior(drafter, False) is greedy and lookup_prior(drafter, True) is not greedy
    first_call_counts(greedy)
    assert LookupAcceptance(prior=lookup_prior(drafter, False)).prior_means[True] == pytest.approx(3 / 7)
    assert LookupAcceptance(prior=lookup_prior(drafter, True)).prior_means[True] == 0.5
    reset_lookup_prior(drafter)
    assert lookup_prior(drafter, False) is not greedy and lookup_prior(drafter, False).means()[True] == 0.5


# ---------------------------------------------------------------------------------- the choice
def theta(conditionals, length):
    return expected_throughputs(conditionals, SPS)[length]


def test_plan_lookup_when_it_beats_dspark():
    lookup, dspark = [0.95] * 6, [0.5] * 4
    source, k, length, value = plan_round(lookup, dspark, SPS, 4)
    best = max(range(1, 7), key=lambda j: theta(lookup, j))
    assert (source, k, length) == ("lookup", best, best) and value == pytest.approx(theta(lookup, best))
    assert value > max(expected_throughputs(dspark, SPS))


def test_plan_dspark_when_lookup_is_poor_or_absent():
    dspark = [0.8] * 4
    best = max(expected_throughputs(dspark, SPS))
    assert plan_round([0.3, 0.3, 0.3], dspark, SPS, 4) == ("dspark", 0, None, pytest.approx(best))
    assert plan_round([], dspark, SPS, 4) == ("dspark", 0, None, pytest.approx(best))
    assert plan_round([0.99], None, SPS, 4) == ("dspark", 0, None, 0.0)  # no block drafted yet


def test_plan_hybrid_when_lookup_leads_and_dspark_continues():
    lookup, dspark = [0.95, 0.1], [0.4, 0.9, 0.9, 0.9]
    source, k, length, value = plan_round(lookup, dspark, SPS, 4)
    assert (source, k, length) == ("hybrid", 1, 4)
    assert value == pytest.approx(theta([0.95, 0.9, 0.9, 0.9], 4))
    assert value > max(max(expected_throughputs(dspark, SPS)), max(expected_throughputs(lookup, SPS)))
    assert plan_round(lookup, dspark, SPS, 1)[0] != "hybrid"  # γ = 1 leaves no position after a lookup token


def test_plan_tie_goes_to_lookup():
    c = [0.9, 0.9, 0.9]
    assert plan_round(c, c, SPS, 3)[0] == "lookup"


def test_drafting_cost_moves_the_choice_to_lookup_or_to_the_target_alone():
    """A round that runs the drafter pays its pass: with 30 ms per pass, DSpark's [0.5] * 4 (best Θ 16.3 tokens/s free,
    12.9 with the pass) loses to a lookup continuation of [0.5, 0.5] (15.9) that it beat for free; and where verifying
    more than one token is dear, weak drafts (10.5) and lookup (6.9) lose to the target alone (1000 / 65 = 15.4)."""
    drafted = [1.0 / (1.0 / s + 0.030) for s in SPS]
    dspark, lookup = [0.5] * 4, [0.5, 0.5]
    assert plan_round(lookup, dspark, SPS, 4)[0] == "dspark"  # free drafting: the paper's Θ
    assert max(expected_throughputs(dspark, drafted)) < max(expected_throughputs(lookup, SPS)[1:])
    source, k, length, value = plan_round(lookup, dspark, SPS, 4, drafted)
    assert (source, k, length) == ("lookup", 2, 2) and value == pytest.approx(theta(lookup, 2))
    steep = [SPS[0]] + [s / 2 for s in SPS[1:]]  # verifying 2+ tokens costs twice one: no lookup pays off either
    assert plan_round([0.5], [0.3] * 4, steep, 4, drafted) == ("target", 0, 0, pytest.approx(SPS[0]))
    assert plan_round([0.5], [0.3] * 4, steep, 4)[0] == "dspark"  # free drafting: DSpark's ℓ = 0 ties the target


def test_round_rates_add_the_costs_outside_the_verification():
    curve = tiny_sps_curve()
    assert curve.round_rates(0, True, curve.max_tokens) == pytest.approx(curve.steps_per_s)  # nothing learnt yet: SPS itself
    curve.observe_round(0.005, 0.010)  # first observations are taken as they are
    assert (curve.overhead_ms, curve.draft_ms) == pytest.approx((5.0, 10.0))
    assert curve.round_rates(0, False, 1)[0] == pytest.approx(1000 / 70)
    assert curve.round_rates(0, True, 2)[1] == pytest.approx(1000 / 124)
    curve.observe_round(0.005 * 10, None)  # a round without a drafter pass leaves draft_ms; EMA in log space
    assert (curve.overhead_ms, curve.draft_ms) == pytest.approx((5.0 * 10 ** 0.1, 10.0))
    with pytest.raises(ValueError, match="times >= 0"):
        curve.observe_round(-1.0)


def test_a_stale_estimate_is_refreshed_by_drafting():
    """When the target alone wins, the DSpark estimate it was judged by ages; after REFRESH_ROUNDS rounds without a
    drafted block the round drafts anyway (a function of the round count, never of a draft). The probe is free here:
    60 ms alone, 66 + 12 = 78 ms with the drafter's pass and one draft of c_1 = 0.3 (1.3 tokens in 1.3 plain rounds),
    while the target alone still wins by the margin (Θ(ℓ = 1) = 1.3 / 78 ms = 1 / 60 ms)."""
    curve = tiny_sps_curve([60, 66, 80, 90, 100, 110, 120, 130, 140])
    curve.draft_ms = 12.0
    state = LookupDrafting(SequentialTemperatureScaling(temperatures=[1.0] * 4), curve, max_tokens=4)
    state.observe_block(torch.tensor([0.3] * 4))
    ids = torch.tensor([[1, 2, 3]])  # no lookup match
    sources = [state.plan(ids, 4, room=4).source for _ in range(REFRESH_ROUNDS + 1)]
    assert sources == ["target"] * REFRESH_ROUNDS + ["dspark"]
    state.observe_block(torch.tensor([0.3] * 4))
    assert state.plan(ids, 4, room=4).source == "target"


def test_a_proposal_must_beat_the_target_alone_by_the_margin():
    """Flat rates: DSpark's best Θ is (1 + .2 + .04 + .008 + .0016) · 90 = 112.46 against 100 for the target alone."""
    rates = [100.0, 90.0, 90.0, 90.0, 90.0]
    assert max(expected_throughputs([0.2] * 4, rates)) == pytest.approx(1.2496 * 90)
    assert plan_round([], [0.2] * 4, rates, 4, margin=0.0)[0] == "dspark"
    assert plan_round([], [0.2] * 4, rates, 4, margin=0.12)[0] == "dspark"  # 112.46 > 112
    assert plan_round([], [0.2] * 4, rates, 4, margin=0.13)[:3] == ("target", 0, 0)  # 112.46 < 113
    assert plan_round([0.2] * 4, None, rates, 4, margin=0.5)[0] == "dspark"  # no estimate yet: draft to get one


@pytest.mark.parametrize(("confidence", "draft_ms", "factor", "wait", "probes"), [
    (0.3, 12.0, 1.0, 4, [5, 9, 17, 33, 65, 65]),  # a probe loses 78 / 60 - 1.3 = 0: the intervals alone
    (0.155, 12.0, 1.0, 15, [16, 31, 61, 65, 65, 65]),  # loses 1.3 - 1.155 = 0.145 plain rounds: ceil(14.5) = 15
    (0.31, 12.0, 0.5, 15, [16, 31, 61, 65, 65, 65]),  # the same c_1 = 0.155 after the online correction
    (0.155, 30.0, 1.0, 45, [46, 65, 65, 65, 65, 65]),  # 96 / 60 - 1.155 = 0.445: ceil(44.5) = 45 rounds
    (0.155, 120.0, 1.0, 64, [65] * 6),  # 186 / 60 - 1.155 = 1.945: 195 rounds, capped at 64
])
def test_probes_are_spaced_by_their_price_and_back_off_until_dspark_wins_again(confidence, draft_ms, factor, wait,
                                                                                probes):
    """A probe is a "target" round turned into a DSpark round (that verifies a draft) once the estimate is older than
    the probe's wait: the interval (REFRESH_ROUNDS at first), or more where the probe's expected loss, ``60 ms alone
    against 66 ms + draft_ms`` for ``1 + c_1`` tokens, would exceed PROBE_LOSS_BOUND = 1 % of the plain rounds it
    waits. Each probe doubles the wait (up to MAX_PROBE_INTERVAL), and a round that plans DSpark on its own merits
    brings the interval back to REFRESH_ROUNDS (the price still applies)."""
    assert (REFRESH_ROUNDS, PROBE_LOSS_BOUND, MAX_PROBE_INTERVAL) == (4, 0.01, 64)
    curve = tiny_sps_curve([60, 66, 80, 90, 100, 110, 120, 130, 140])  # ms per B
    curve.draft_ms = draft_ms
    correction = OnlineCorrection(prior=1.0)
    if factor != 1.0:
        correction.observe([1.0], 0)  # f = (0 + 1) / (1 + 1)
    assert correction.factor == factor
    state = LookupDrafting(SequentialTemperatureScaling(temperatures=[1.0] * 4), curve, 4, correction)
    ids = torch.tensor([[1, 2, 3]])  # no lookup match

    def rounds_until_probe():
        for n in range(1, 2 * MAX_PROBE_INTERVAL):
            plan = state.plan(ids, 4, room=4)
            if plan.probe:
                assert plan.source == "dspark" and plan.length is None
                state.observe_block(torch.tensor([confidence] * 4))
                return n
            assert plan.source == "target"
        raise AssertionError("no probe")

    state.observe_block(torch.tensor([confidence] * 4))
    assert state.probe_wait(1000 / 60, 1000 / (66 + draft_ms)) == wait
    assert [rounds_until_probe() for _ in range(6)] == probes
    state.observe_block(torch.tensor([0.99] * 4))  # a block worth its pass
    plan = state.plan(ids, 4, room=4)
    assert plan.source == "dspark" and not plan.probe and state.probe_interval == REFRESH_ROUNDS
    state.observe_block(torch.tensor([confidence] * 4))
    assert rounds_until_probe() == wait + 1


def test_the_dspark_estimate_carries_the_online_correction():
    correction = OnlineCorrection()
    state = LookupDrafting(SequentialTemperatureScaling(temperatures=[1.0] * 4), tiny_sps_curve(), 4, correction)
    state.observe_block(torch.tensor([0.5, 0.4, 0.3, 0.2]))
    correction.observe([0.5, 0.4], 0)  # f = 1 / 1.5 (the default prior m = 1; position 1 reached)
    assert state.dspark_estimate() == pytest.approx([0.5 / 1.5, 0.4 / 1.5, 0.3 / 1.5, 0.2 / 1.5])
    assert state.block_estimate == pytest.approx([0.5, 0.4, 0.3, 0.2])  # kept uncorrected: f is read at plan time


def test_plan_rejects_bad_estimates():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        plan_round([1.5], [0.5] * 4, SPS, 4)


def test_drafting_state_plans_from_the_text_and_learns():
    calibration = SequentialTemperatureScaling(temperatures=[1.0] * 4)
    state = LookupDrafting(calibration, tiny_sps_curve(), max_tokens=16)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2]])
    assert state.plan(ids, 4, room=10).source == "dspark"  # no block drafted yet
    state.observe_block(torch.tensor([0.3, 0.3, 0.3, 0.3]))
    assert state.block_estimate == pytest.approx([0.3] * 4)
    plan = state.plan(ids, 4, room=3)
    assert state._match == LookupMatch((3, 4, 5), 2)  # room caps the continuation
    assert plan.source == "lookup" and plan.lookup_tokens == (3, 4, 5)[: plan.length]
    state.update(torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 9]]), num_matches=2)  # 3, 4 accepted, 9 != 5
    assert state.acceptance.accepted[2:4] == [1, 1] and state.acceptance.rejected[4] == 1
    assert state._match is None


def test_lookup_enabled_validates():
    target = cycle_target(1, 0.026)
    drafter = cycle_drafter(target, "markov")
    assert lookup_enabled(False, drafter, 4, "async") is False
    with pytest.raises(ValueError, match="None \\(automatic\\), True or False"):
        lookup_enabled("yes", drafter, 4, "async")
    with pytest.raises(ValueError, match="dspark calibrate"):
        lookup_enabled(True, drafter, 4, "async")  # no calibration
    assert lookup_enabled(None, drafter, 4, "async") is False  # automatic: off without a calibration
    drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * 3)
    with pytest.raises(ValueError, match="γ = 4"):
        lookup_enabled(True, drafter, 4, "async")
    assert lookup_enabled(True, drafter, 3, "fixed") is True
    with pytest.raises(ValueError, match="confidence head"):
        lookup_enabled(True, cycle_drafter(target, "markov", confidence_head=False), 3, "async")
    # automatic (the default): on in the scheduled modes of a drafter calibrated for γ, off in the others
    assert [lookup_enabled(None, drafter, 3, m) for m in ("fixed", "threshold", "scheduler", "async")] == \
        [False, False, True, True]
    assert lookup_enabled(None, drafter, 4, "async") is False  # γ beyond the calibration
    assert lookup_enabled(None, cycle_drafter(target, "markov", confidence_head=False), 3, "async") is False


# ---------------------------------------------------------------------------- proposals
def test_one_hot_logits_are_the_lookup_proposal():
    logits = one_hot_logits(torch.tensor([2, 0]), 5)
    assert torch.equal(logits.softmax(-1), torch.eye(5)[[2, 0]])


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_draft_continues_from_forced_lookup_tokens(head):
    """The sequential head takes the forced tokens as previous tokens: the cycle drafter predicts f(x) after x."""
    target = cycle_target(1, 0.026)
    drafter = cycle_drafter(target, head).bind(target)
    context = drafter.new_context()
    drafter.extend_context(context, torch.randn(1, 3, drafter.config.context_width))
    forced = torch.tensor([5, 9])
    block = drafter.draft(context, anchor=1, block_size=4, forced_tokens=forced)
    assert block.tokens.tolist() == [5, 9, int(CYCLE[9]), int(CYCLE[CYCLE[9]])]
    free = drafter.draft(context, anchor=1, block_size=4)
    assert free.tokens[0] == CYCLE[1] and not torch.equal(free.confidences[2:], block.confidences[2:])
    sampled = drafter.draft(context, anchor=1, block_size=4, do_sample=True, forced_tokens=forced)
    assert sampled.tokens[:2].tolist() == [5, 9]
    assert torch.equal(sampled.logits[:2].softmax(-1), torch.eye(drafter.config.vocab_size)[[5, 9]])
    with pytest.raises(ValueError, match="leave a position"):
        drafter.draft(context, anchor=1, block_size=2, forced_tokens=forced)


def test_what_lookup_needs_is_one_rule_read_by_generate_the_cli_and_the_bench():
    """``lookup_missing`` decides for ``lookup_enabled``, ``dspark generate --lookup`` and the bench's hybrid method."""
    from dspark_hf.bench.methods import lookup_mode_of
    from dspark_hf.cli.generate import check_settings
    from dspark_hf.decoding.lookup import lookup_missing

    target = cycle_target(1, 0.026)
    calibrated = cycle_drafter(target, "markov")
    calibrated.calibration = SequentialTemperatureScaling(temperatures=[1.0] * 3)
    cases = [(cycle_drafter(target, "markov", confidence_head=False), 3, "confidence head"),
             (cycle_drafter(target, "markov"), 3, "calibrated confidences for γ = 3"),
             (calibrated, 4, "calibrated confidences for γ = 4"), (calibrated, 3, None)]
    for drafter, gamma, missing in cases:
        found = lookup_missing(drafter, gamma)
        assert (found is None) if missing is None else (missing in found)
        assert (lookup_mode_of(drafter, gamma) is None) == (missing is not None)
        if missing is None:
            check_settings(drafter, "fixed", gamma, lookup=True)  # passes
        else:
            with pytest.raises(SystemExit, match="--lookup"):
                check_settings(drafter, "fixed", gamma, lookup=True)
