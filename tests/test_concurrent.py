"""Many requests at once (issue 24): `target.generate(**batch, assistant_model=drafter)` with several rows, the
closed-loop `generate_concurrent`, the ragged target forward underneath and its KV rollback.

Every row must equal its own batch-1 plain `generate` (greedy) or follow the target's law (sampling, chi-square
against the enumerated law of each row's prompt), whatever the other rows do.
"""

import pytest
import torch
from conftest import (
    CPU_MS,
    CYCLE_INV,
    CYCLE_VOCAB,
    cycle_drafter,
    cycle_target,
    scheduled_cycle_drafter,
    tiny_llama,
    tiny_sps_curve,
)
from test_generation import (
    LEAK_TOKEN,
    SV,
    char_tokenizer,
    chi_square,
    coin_flip_plan,
    cycle_prompt,
    exact_laws,
    ready_cycle_drafter,
    sampling_drafter,
)
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer
from transformers.generation.streamers import BaseStreamer

from dspark_hf import ConcurrentDecoder, generate_concurrent
from dspark_hf.bench.concurrency import markdown, run_concurrency, write
from dspark_hf.decoding.alone import AlonePlanner
from dspark_hf.decoding.batch_costs import MAX_REMEASURE_INTERVAL, DraftGate, StepCosts, learnt_costs
from dspark_hf.decoding.calibration import OnlineCorrection
from dspark_hf.decoding.lookup import RoundPlan, find_continuation
from dspark_hf.decoding.lookup_acceptance import LookupAcceptance, LookupPrior, reset_lookup_prior
from dspark_hf.runtime.ragged import RaggedBatch, RequestKV, ragged_attention, ragged_forward

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = ("scheduler", "async", "fixed", "threshold")
PROMPTS = [[3, 5, 7], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44]]  # a one-token prompt included
MAX_NEW = 14


@pytest.fixture(scope="module")
def target():
    return cycle_target(num_hidden_layers=2, alpha=0.026)


@pytest.fixture(scope="module")
def drafter(target):
    return scheduled_cycle_drafter(target)


class ScriptedGate(DraftGate):
    """Drafts at two steps of every three, whatever was measured: the engine's tests see drafting steps, plain steps
    with a drafter attached and the context catch-up after them, independent of this machine's timings (the real
    rule has its own tests below)."""

    def __init__(self):
        super().__init__()
        self.calls, self.catch_ups = 0, []

    def drafts(self, costs, requests, context, catch_up=0):
        self.calls += 1
        self.catch_ups.append(catch_up)
        return self.calls % 3 != 0


class ShutGate(DraftGate):
    """Never drafts: every step of two or more requests is plain, the drafter attached."""

    def drafts(self, costs, requests, context, catch_up=0):
        return False


@pytest.fixture(autouse=True)
def fresh_lookup_prior(drafter):
    """Each test's requests start prompt lookup from Beta(1, 1), whatever the tests before them taught the drafter
    (the lookup prior is learnt across a drafter's calls, issue #28)."""
    reset_lookup_prior(drafter)


@pytest.fixture(autouse=True)
def scripted_gate(monkeypatch):
    monkeypatch.setattr("dspark_hf.decoding.concurrent.learnt_costs", lambda drafter, curve, settings: (
        StepCosts(curve), ScriptedGate()))


def left_padded(prompts, pad=0):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def plain(target, prompt, max_new=MAX_NEW, **kwargs):
    """The reference: the row alone, batch 1, plain greedy generate (new tokens only)."""
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------------- greedy identity
@pytest.mark.parametrize("mode", MODES)
def test_batched_generate_greedy_rows_equal_their_own_plain_generate(target, drafter, mode):
    ids, mask = left_padded(PROMPTS)
    out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=MAX_NEW,
                          do_sample=False, dspark_verification=mode)
    assert out.shape == (len(PROMPTS), ids.shape[1] + MAX_NEW)
    assert torch.equal(out[:, :ids.shape[1]], ids)  # the padded prompts come back as given
    for i, prompt in enumerate(PROMPTS):
        assert out[i, ids.shape[1]:].tolist() == plain(target, prompt)
    stats = drafter.last_stats
    assert len(stats) == len(PROMPTS) and all(row.new_tokens == MAX_NEW for row in stats.rows)
    assert any(r.accepted > 0 for row in stats.rows for r in row.rounds)  # the drafts did something
    if mode == "fixed":  # every request verifies its γ_r: B = Σ (1 + γ_r) in every round
        assert all(step.batch_tokens == sum(1 + n for n in step.lengths) for step in stats.steps if not step.prefill)


def test_rows_stop_at_eos_in_the_middle_of_a_block(target, drafter):
    """An EOS that one row reaches mid-block ends that row there (the rest of its accepted drafts are dropped)
    while the other rows go on; finished rows are padded, as batched plain generate pads them."""
    eos = plain(target, PROMPTS[0])[5]
    ids, mask = left_padded(PROMPTS)
    out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=MAX_NEW,
                          do_sample=False, dspark_verification="fixed", eos_token_id=eos, pad_token_id=0)
    width, lengths = ids.shape[1], []
    for i, prompt in enumerate(PROMPTS):
        reference = plain(target, prompt, eos_token_id=eos, pad_token_id=0)
        reference = reference[: reference.index(eos) + 1] if eos in reference else reference  # plain pads after EOS
        assert out[i, width:width + len(reference)].tolist() == reference
        assert not out[i, width + len(reference):].any()  # then the pad token
        assert drafter.last_stats[i].new_tokens == len(reference)
        lengths.append(len(reference))
    assert min(lengths) < MAX_NEW and len(set(lengths)) > 1  # rows finished at different steps
    stopped = drafter.last_stats[0].rounds[-1]
    assert stopped.scheduled > stopped.accepted  # its last block went past the EOS


class StopAfter(StoppingCriteria):
    """A custom criterion: a row stops once it emits ``token`` after the prompt width."""

    def __init__(self, token, width):
        self.token, self.width = token, width

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.width:] == self.token).any(-1)


def test_processors_and_custom_stops_see_rows_as_batched_plain_generate(target, drafter):
    """A repetition penalty (per-row state: transformers' ``prompt_ignore_length``) and a custom stopping criterion act
    on each left-padded row as in batched plain generate, the reference here; a row that meets the criterion ends
    there (plain generate without an EOS keeps writing into a stopped row; it is cut at the stop for comparison)."""
    ids, mask = left_padded(PROMPTS)
    width = ids.shape[1]
    stop_token = plain(target, PROMPTS[2])[4]
    settings = dict(max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=1.3, pad_token_id=0,
                    stopping_criteria=StoppingCriteriaList([StopAfter(stop_token, width)]))
    reference = target.generate(input_ids=ids, attention_mask=mask, **settings)[:, width:].tolist()
    out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, dspark_verification="fixed",
                          **settings)[:, width:].tolist()
    stopped = 0
    for row, expected in zip(out, reference):
        if stop_token in expected:
            expected, stopped = expected[: expected.index(stop_token) + 1], stopped + 1
        assert row[: len(expected)] == expected and not any(row[len(expected):])
    assert stopped >= 2  # two rows stop early, two run to max_new_tokens


def test_a_row_whose_drafts_are_always_rejected(target, drafter, monkeypatch):
    """Row 1 drafts the cycle's predecessor (never the target's choice here): it verifies γ drafts each round,
    accepts none, and still equals its plain generate, as do the rows around it."""
    draft_many = type(drafter).draft_many
    decoder = ConcurrentDecoder(target, drafter, verification="fixed")
    requests = [decoder.add(p, MAX_NEW) for p in PROMPTS[:3]]

    def wrong_for_row_one(self, contexts, anchors, *args, **kwargs):
        blocks = draft_many(self, contexts, anchors, *args, **kwargs)
        for block, context in zip(blocks, contexts):
            if context is requests[1].context:
                block.tokens = CYCLE_INV[block.tokens]
        return blocks

    monkeypatch.setattr(type(drafter), "draft_many", wrong_for_row_one)
    with decoder.running():
        while decoder.active:
            decoder.step()
    for request, prompt in zip(requests, PROMPTS):
        assert request.generated == plain(target, prompt)
    rejected = requests[1].stats.rounds
    assert all(r.accepted == 0 and r.scheduled == r.drafted > 0 for r in rejected[:-1])
    assert sum(r.accepted for r in requests[0].stats.rounds) > 0


def test_generate_concurrent_closed_loop_streams_and_frees_finished_requests(target, drafter):
    prompts = PROMPTS + [[20, 21], [33]]
    streamed = {i: [] for i in range(len(prompts))}
    outputs, stats = generate_concurrent(target, drafter, prompts, max_concurrency=2, max_new_tokens=10,
                                         verification="scheduler",
                                         on_tokens=lambda i, tokens: streamed[i].extend(tokens))
    for i, prompt in enumerate(prompts):
        assert outputs[i] == plain(target, prompt, max_new=10) == streamed[i]
    assert max(step.requests for step in stats.steps) == 2
    assert len(stats) == len(prompts) and stats.tau > 1.0
    # each request's first drafting step feeds its prompt's features to the drafter: a catch-up kept apart
    assert any(step.extend_ms > 0 for step in stats.steps if step.drafted)
    assert all(step.extend_ms <= step.draft_ms for step in stats.steps)
    assert all(step.extend_ms == 0 for step in stats.steps if not step.drafted)
    # a request that drafted the step before extends by that step's features alone: its drafting price, no catch-up
    steady = [b for a, b in zip(stats.steps, stats.steps[1:])
              if not a.prefill and a.drafted == a.requests and not b.prefill and b.drafted == b.requests]
    assert steady and all(step.extend_ms == 0 for step in steady)


def test_a_decoder_warms_its_drafter_once_per_block_size(target, monkeypatch):
    drafter = ready_cycle_drafter(target, "markov")
    real, passes = drafter.draft, []
    monkeypatch.setattr(drafter, "draft", lambda context, anchor, gamma, *a, **k: (
        passes.append(gamma), real(context, anchor, gamma, *a, **k))[1])
    for block_size in (3, 3, 2):
        ConcurrentDecoder(target, drafter, verification="fixed", block_size=block_size)
    assert passes == [3, 2]


def test_scheduled_modes_verify_anchors_only_in_a_step_that_prefills_a_newcomer(target, drafter):
    """A newcomer's prompt rides in the running request's round, and a scheduled mode drafts nothing there (its time
    is the prompt's); whether requests finish at the same step depends on timed decisions, so the newcomer is added
    by hand once the first request is done, while the second (budget 30, at most 1 + 2·(γ + 1) tokens by then) runs."""
    decoder = ConcurrentDecoder(target, drafter, verification="scheduler")
    first, second = decoder.add(PROMPTS[0], 2), decoder.add(PROMPTS[1], 30)
    with decoder.running():
        while not first.done:
            decoder.step()
        third, before = decoder.add(PROMPTS[3], 4), len(decoder.stats.steps)
        while decoder.active:
            decoder.step()
    fused = decoder.stats.steps[before]
    assert (fused.requests, fused.prefilled, fused.prefill, fused.drafted, fused.lengths) == (2, 1, False, 0, [0])
    assert fused.batch_tokens == 1 + len(PROMPTS[3])
    for request, prompt, budget in ((first, 0, 2), (second, 1, 30), (third, 3, 4)):
        assert request.generated == plain(target, PROMPTS[prompt], max_new=budget)


def test_a_newcomers_prompt_is_prefilled_in_the_running_requests_step(target):
    """Plain batched decoding, budgets 2 and 5, a third request (budget 3) added when the first finishes: its prompt
    joins the second request's step (B = 1 + 5 prompt tokens), so 5 forwards serve all three, not 6."""
    decoder = ConcurrentDecoder(target, None)
    first, second = decoder.add(PROMPTS[0], 2), decoder.add(PROMPTS[1], 5)
    with decoder.running():
        decoder.step()
        decoder.step()
        assert first.done and len(second.generated) == 2
        third = decoder.add(PROMPTS[3], 3)
        while decoder.active:
            decoder.step()
    assert [(s.requests, s.prefilled, s.prefill, s.batch_tokens) for s in decoder.stats.steps] == [
        (2, 2, True, 4), (2, 0, False, 2), (2, 1, False, 6), (2, 0, False, 2), (2, 0, False, 2)]
    for request, prompt, budget in ((first, 0, 2), (second, 1, 5), (third, 3, 3)):
        assert request.generated == plain(target, PROMPTS[prompt], max_new=budget)


def test_fixed_mode_drafts_in_a_step_that_prefills_a_newcomer(target, drafter):
    """``fixed`` drafts in every step, one that prefills a newcomer included; each request equals its plain
    ``generate``."""
    prompts = PROMPTS + [[20, 21], [33]]
    outputs, stats = generate_concurrent(target, drafter, prompts, max_concurrency=2, max_new_tokens=10,
                                         verification="fixed")
    assert outputs == [plain(target, prompt, max_new=10) for prompt in prompts]
    fused = [step for step in stats.steps if step.prefilled and not step.prefill]
    assert any(step.drafted for step in fused)


def test_generate_concurrent_stops_at_the_targets_eos_by_default(target, drafter, monkeypatch):
    """No ``eos_token_ids``: each request ends where plain ``generate`` ends, at the target's own EOS (kept)."""
    eos = plain(target, PROMPTS[0])[5]
    monkeypatch.setattr(target.generation_config, "eos_token_id", eos)
    outputs, _ = generate_concurrent(target, drafter, PROMPTS, max_concurrency=2, max_new_tokens=MAX_NEW,
                                     verification="scheduler")
    for prompt, output in zip(PROMPTS, outputs):
        reference = plain(target, prompt, pad_token_id=0)
        assert output == (reference[: reference.index(eos) + 1] if eos in reference else reference)
    assert len(outputs[0]) == 6  # the EOS at the sixth new token ends request 0
    outputs, _ = generate_concurrent(target, drafter, PROMPTS[:1], max_new_tokens=MAX_NEW, eos_token_ids=())
    assert len(outputs[0]) == MAX_NEW  # () turns the stop off


@pytest.mark.parametrize("mode", ["fixed", "threshold"])
def test_one_request_runs_the_rounds_of_the_single_request_path(target, drafter, mode):
    """At R = 1 the engine drafts, verifies and accepts what `generate` with one prompt does, round for round."""
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        single = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                 max_new_tokens=MAX_NEW, dspark_verification=mode, dspark_lookup=False)
        expected = [(r.drafted, r.scheduled, r.accepted, r.draft_tokens) for r in drafter.last_stats.rounds]
        outputs, stats = generate_concurrent(target, drafter, [prompt], max_concurrency=1, max_new_tokens=MAX_NEW,
                                             verification=mode)
        assert outputs[0] == single[0, len(prompt):].tolist()
        assert [(r.drafted, r.scheduled, r.accepted, r.draft_tokens) for r in stats[0].rounds] == expected


def test_plain_batched_decoding_without_a_drafter(target):
    outputs, stats = generate_concurrent(target, None, PROMPTS, max_concurrency=4, max_new_tokens=8)
    assert outputs == [plain(target, p, max_new=8) for p in PROMPTS]
    decode_steps = [s for s in stats.steps if not s.prefill]
    assert all(s.batch_tokens == s.requests for s in decode_steps) and len(decode_steps) == 7


def test_finished_requests_release_their_caches(target, drafter):
    decoder = ConcurrentDecoder(target, drafter, verification="fixed")
    short, long = decoder.add([3, 5, 7], 2), decoder.add([9], 12)
    with decoder.running():
        while decoder.active:
            decoder.step()
            if short.done:
                assert short.kv is None and short.context is None
    assert long.done and long.kv is None and len(long.generated) == 12 and len(short.generated) == 2


def test_queued_features_equal_the_targets_hidden_states_of_a_full_forward(target, drafter, monkeypatch):
    """With the gate held shut each request queues one feature row per position it has run, from the step's
    features shared by all its requests (a newcomer's prompt rides with the running requests' step): the queue
    equals the drafter's context layers of one full target forward of its tokens (fp32, 1e-5), and the catch-up
    the gate hears counts them."""
    monkeypatch.setattr("dspark_hf.decoding.concurrent.learnt_costs", lambda drafter, curve, settings: (
        StepCosts(curve), ShutGate()))
    decoder = ConcurrentDecoder(target, drafter, verification="scheduler", max_requests=3, eos_token_ids=())
    requests = [decoder.add(PROMPTS[2], 20), decoder.add(PROMPTS[0], 20)]
    with decoder.running():
        for step in range(6):
            if step == 2:
                requests.append(decoder.add(PROMPTS[3], 20))  # prefilled in the running requests' step
            decoder.step()
    assert [len(r.pending) for r in requests] == [6, 6, 4]
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    for request in requests:
        assert request.catch_up_tokens == len(request.ids) - 1
        with torch.no_grad():
            hidden = target(input_ids=torch.tensor([request.ids[:-1]]), output_hidden_states=True).hidden_states
        queued = request.take_features()
        torch.testing.assert_close(queued, torch.cat([hidden[i] for i in layers], -1), rtol=0, atol=1e-5)
        assert request.pending == [] and request.catch_up_tokens == 0


# -------------------------------------------------------------------------------------------- rollback
def test_rollback_logits_equal_a_full_recompute():
    """Two requests verify drafts in one ragged forward, are rolled back to what was accepted, then step again:
    the new logits equal those of the accepted sequences recomputed from scratch (fp32, 1e-4)."""
    target = tiny_llama(97, 32, 2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (6, 2)]
    drafts = [torch.randint(0, 97, (4,), generator=g).tolist() for _ in prompts]
    accepted = [1, 3]
    caches = [RequestKV(2), RequestKV(2)]
    with torch.no_grad(), ragged_attention(target):
        ragged_forward(target, torch.tensor([prompts[0] + prompts[1]]), RaggedBatch(caches, [6, 2]),
                       torch.tensor([7]))
        anchors = [50, 60]
        segments = [[a] + d for a, d in zip(anchors, drafts)]
        ragged_forward(target, torch.tensor([segments[0] + segments[1]]), RaggedBatch(caches, [5, 5]),
                       torch.arange(10))
        for cache, prompt, n in zip(caches, prompts, accepted):
            cache.truncate(len(prompt) + 1 + n)
        nxt = [[70], [71, 72]]  # a bonus token, and a bonus token with one more draft
        logits = ragged_forward(target, torch.tensor([nxt[0] + nxt[1]]), RaggedBatch(caches, [1, 2]),
                                torch.arange(3))
        rows = [logits[:1], logits[1:]]
        for prompt, anchor, draft, n, new, row in zip(prompts, anchors, drafts, accepted, nxt, rows):
            sequence = torch.tensor([prompt + [anchor] + draft[:n] + new])
            full = target(sequence).logits[0, -len(new):]
            assert torch.allclose(row, full, atol=1e-4), (row - full).abs().max()
    assert target.config._attn_implementation == "sdpa"  # restored after the block


# --------------------------------------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def sampling_rows():
    target = tiny_llama(SV, 16, 1, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                        pad_token_id=None, initializer_range=0.3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)
    prompts = [[0, 0, 4], [4], [1, 0, 5, 2]]
    return target, prompts, [exact_laws(target, torch.tensor([p])) for p in prompts]


@pytest.mark.parametrize("mode", ["scheduler", "fixed"])
def test_batched_sampling_is_exact_per_row(sampling_rows, mode):
    """R = 3 rows of different prompt lengths sampled together: each row's (t1, t2) and (t2, t3) follow that
    row's own target law (Algorithm 1 picks ℓ_r across the rows in the scheduler mode)."""
    target, prompts, laws = sampling_rows
    drafter = sampling_drafter(target)
    ids, mask = left_padded(prompts, pad=0)
    width, n = ids.shape[1], 200
    tables = [(torch.zeros(SV, SV), torch.zeros(SV, SV)) for _ in prompts]
    verified = 0
    torch.manual_seed(1234)
    for _ in range(n):
        out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=3,
                              do_sample=True, temperature=1.0, top_k=None, dspark_verification=mode,
                              dspark_block_size=4, pad_token_id=0)
        for row, (first, second) in zip(out[:, width:].tolist(), tables):
            first[row[0], row[1]] += 1
            second[row[1], row[2]] += 1
        verified += sum(r.scheduled for row in drafter.last_stats.rows for r in row.rounds)
    assert verified > 0
    for (first, second), (law1, law2) in zip(tables, laws):
        for counts, law in ((first, law1), (second, law2)):
            x2, df, p = chi_square(counts, law.float(), n)
            assert p > 1e-3, (mode, x2, df, p)


@pytest.mark.parametrize("mode", ["scheduler", "fixed"])
def test_sampling_is_exact_for_a_newcomer_prefilled_with_a_running_request(sampling_rows, mode):
    """A closed loop: row 0 stops after one token, row 2 is added then and prefilled in row 1's next step; rows 1 and
    2 each follow their own target law."""
    target, prompts, laws = sampling_rows
    drafter = sampling_drafter(target)
    n, tables, fused = 200, [(torch.zeros(SV, SV), torch.zeros(SV, SV)) for _ in prompts[1:]], 0
    torch.manual_seed(99)
    for _ in range(n):
        decoder = ConcurrentDecoder(target, drafter, verification=mode, do_sample=True, block_size=4,
                                    eos_token_ids=())
        decoder.add(prompts[0], 1)
        rows = [decoder.add(prompts[1], 3)]
        with decoder.running():
            decoder.step()
            rows.append(decoder.add(prompts[2], 3))
            while decoder.active:
                decoder.step()
        fused += decoder.stats.steps[1].prefilled == 1 and decoder.stats.steps[1].requests == 2
        for row, (first, second) in zip(rows, tables):
            t = row.generated
            first[t[0], t[1]] += 1
            second[t[1], t[2]] += 1
    assert fused == n
    for (first, second), (law1, law2) in zip(tables, laws[1:]):
        for counts, law in ((first, law1), (second, law2)):
            x2, df, p = chi_square(counts, law.float(), n)
            assert p > 1e-3, (mode, x2, df, p)


# ------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def forward_calls(target):
    calls = []
    handle = target.register_forward_pre_hook(lambda module, args: calls.append(1))
    yield calls
    handle.remove()


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_beams=2), "num_beams"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
    (dict(return_dict_in_generate=True), "return_dict_in_generate"),
    (dict(dspark_lookup=True), "dspark_lookup"),
    (dict(dspark_verification="nope"), "verification"),
])
def test_batched_generate_rejects_unsupported_options_before_compute(target, drafter, forward_calls, kwargs, match):
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match=match):
        target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, **kwargs)
    assert not forward_calls


class Silent(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


def test_right_padding_and_streamers_raise(target, drafter, forward_calls):
    ids = torch.tensor([[9, 0, 0], [3, 5, 7]])
    with pytest.raises(ValueError, match="left"):
        target.generate(input_ids=ids, attention_mask=torch.tensor([[1, 0, 0], [1, 1, 1]]), assistant_model=drafter,
                        max_new_tokens=4)
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError) as streamed:  # a streamer that takes a batch: DSpark's check names on_tokens
        target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4,
                        streamer=Silent())
    assert str(streamed.value) == ("Streamers take one row; with a batch, use dspark_hf.generate_concurrent(..., "
                                   "on_tokens=...) or call generate once per prompt.")
    assert not forward_calls


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_beams=2), "not beam_search; set num_beams=1"),
    (dict(num_beams=2, do_sample=True), "not beam_sample; set num_beams=1"),
    (dict(num_return_sequences=2), "one sequence per prompt; set num_return_sequences=1"),
    (dict(dspark_verification="fixed"), "- dspark_verification: pass verification="),
    (dict(temperature=0.7), r"- temperature: a generation setting; pass its processor in logits_processor="),
    (dict(max_requests=2), "- max_requests: pass max_concurrency="),
    (dict(verificaton="fixed"), r"- verificaton: neither a setting nor a generate keyword \(a typo\?\)"),
    (dict(return_dict_in_generate=True), r"- return_dict_in_generate: not recorded; generate_concurrent returns"),
    (dict(max_length=20), r"- max_length: pass max_new_tokens="),
])
def test_generate_concurrent_refuses_generate_options_before_compute(target, drafter, forward_calls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_concurrent(target, drafter, PROMPTS[:2], max_concurrency=2, max_new_tokens=4, **kwargs)
    assert not forward_calls


def test_stop_strings_given_as_a_list_are_refused_before_compute(target, drafter, forward_calls):
    with pytest.raises(TypeError, match=r"stop must be a function \(request, ids\) -> bool.*lambda request, ids"):
        generate_concurrent(target, drafter, PROMPTS[:2], max_concurrency=2, max_new_tokens=4, stop=["."])
    assert not forward_calls


def test_a_threshold_given_to_another_mode_warns_in_batches_too(target, drafter):
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.warns(UserWarning, match=r"threshold \(0.3\) is read by the 'threshold' verification mode only; "
                                         r"this decoder verifies in the 'fixed' mode"):
        target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=2,
                        do_sample=False, dspark_verification="fixed", dspark_threshold=0.3)


def test_generate_concurrent_refuses_beams_as_batched_generate_does(target, drafter, forward_calls):
    """One check, one message: beam search refused alike by the closed loop and by batched generate; num_beams=1
    and num_return_sequences=1 are the no-ops they are."""
    ids, mask = left_padded(PROMPTS[:2])
    messages = []
    for call in (lambda: generate_concurrent(target, drafter, PROMPTS[:2], max_new_tokens=4, num_beams=2),
                 lambda: target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4,
                                         num_beams=2)):
        with pytest.raises(ValueError) as error:
            call()
        messages.append(str(error.value))
    assert messages == ["DSpark drafting works with greedy decoding or sampling, not beam_search; set num_beams=1 "
                        "(and drop beam/contrastive options)."] * 2
    assert not forward_calls
    plain = generate_concurrent(target, None, PROMPTS[:2], max_new_tokens=4)[0]
    assert generate_concurrent(target, None, PROMPTS[:2], max_new_tokens=4, num_beams=1,
                               num_return_sequences=1)[0] == plain


def test_transformers_text_streamer_streams_one_prompt_and_is_refused_for_many(target, drafter, forward_calls,
                                                                              capsys):
    """transformers' TextStreamer takes one row: a batch in generate makes it raise its own error when generate streams
    the prompts (before DSpark's check of streamers, which test_right_padding_and_streamers_raise pins), and
    generate_concurrent refuses it naming on_tokens (the closed loop's streaming callback), both before any compute;
    with one prompt it prints what generate returns."""
    tok = char_tokenizer()
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError) as batched:
        target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4,
                        streamer=TextStreamer(tok))
    assert str(batched.value) == "TextStreamer only supports batch size 1"
    with pytest.raises(ValueError, match=r"\n- streamer: pass on_tokens=lambda index, new_ids: \.\.\. \(called after "
                                         r"every step with each prompt's new tokens\)$"):
        generate_concurrent(target, drafter, PROMPTS[:2], max_new_tokens=4, streamer=TextStreamer(tok))
    assert not forward_calls
    prompt = torch.tensor([PROMPTS[2]])
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, max_new_tokens=6,
                          streamer=TextStreamer(tok, skip_prompt=True))
    printed = tok.decode(out[0, prompt.shape[1]:])
    assert len(printed) == 6 and capsys.readouterr().out == printed + "\n"


def test_num_return_sequences_above_one_is_refused_every_way_in(target, drafter, forward_calls):
    """Sampled, one prompt, a batch and the closed loop give DSpark's one message; greedy generate is refused by
    transformers' own check first; all before any compute."""
    ids, mask = left_padded(PROMPTS[:2])
    one = torch.tensor([PROMPTS[0]])
    ours = ("DSpark drafting returns one sequence per prompt; set num_return_sequences=1 (to draw several samples of "
            "a prompt, pass it several times).")
    for call in (
        lambda: target.generate(one, attention_mask=torch.ones_like(one), assistant_model=drafter, max_new_tokens=4,
                                do_sample=True, num_return_sequences=2),
        lambda: target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4,
                                do_sample=True, num_return_sequences=2),
        lambda: generate_concurrent(target, drafter, PROMPTS[:2], max_new_tokens=4, do_sample=True,
                                    num_return_sequences=2),
        lambda: generate_concurrent(target, drafter, PROMPTS[:2], max_new_tokens=4, num_return_sequences=2),
    ):
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == ours
    with pytest.raises(ValueError, match=r"Greedy methods .* do not support `num_return_sequences` different than 1"):
        target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4,
                        num_return_sequences=2)
    assert not forward_calls


def test_engine_rejects_bad_requests(target, drafter):
    with pytest.raises(ValueError, match="max_concurrency"):
        generate_concurrent(target, drafter, [[1]], max_concurrency=0)
    with pytest.raises(ValueError, match="at least one prompt token"):
        generate_concurrent(target, drafter, [[1, 2], []], max_concurrency=1)
    # a new user's trial: "2024" ran as the ids [2, 0, 2, 4]; text and an unwrapped prompt fail before any compute
    for prompts in (["2024"], ["Hi there"], [1, 2, 3], [[1.0, 2.0]], torch.tensor([[[1, 2]]])):
        with pytest.raises(ValueError, match=r"a prompt must be a sequence of token ids, .*a single prompt as \[ids\]"):
            generate_concurrent(target, drafter, prompts, max_concurrency=1, max_new_tokens=2)
    outputs, stats = generate_concurrent(target, drafter, [torch.tensor([1, 2]), (3, 4)], max_new_tokens=2,
                                         verification="fixed")
    assert repr(stats) == f"BatchStats(2 requests, {len(stats.steps)} steps, tau={stats.tau:.2f}, " \
                          f"mean_verified={stats.mean_verified:.2f})"
    assert outputs == [generate_concurrent(target, drafter, [p], max_new_tokens=2, verification="fixed")[0][0]
                       for p in ([1, 2], [3, 4])]
    decoder = ConcurrentDecoder(target, drafter, verification="fixed")
    with pytest.raises(ValueError, match="prompt token"):
        decoder.add([], 4)
    with pytest.raises(ValueError, match="sequence of token ids"):
        decoder.add("12", 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.add([1], 0)
    with pytest.raises(ValueError, match="calibrated"):
        ConcurrentDecoder(target, cycle_drafter(target), verification="scheduler")
    assert CYCLE_VOCAB == target.config.vocab_size


# --------------------------------------------------------------------------------- cost model and gate
def test_step_costs_predict_by_tokens_and_requests():
    costs = StepCosts(tiny_sps_curve())  # 65 ms for B = 1, 110 ms for B = 3, 126 ms for B = 6 ... (conftest.CPU_MS)
    costs.observe(4, overhead_ms=5.0, draft_ms=20.0)
    costs.observe(8, overhead_ms=8.0)
    assert costs.predict_ms(6, 4, 0, drafting=4) == pytest.approx(126 + 5 + 20)
    assert costs.predict_ms(4, 4, 0) == pytest.approx(115 + 5)
    assert costs.predict_ms(6, 6, 0) == pytest.approx(126 + 6.5)  # overhead between R = 4 and 8
    costs.observe(4, overhead_ms=10.0)  # running estimate: 0.8 · 5 + 0.2 · 10
    assert costs.overhead_ms[4] == pytest.approx(6.0)
    assert costs.predict_ms(6, 4, 0, drafting=1) == pytest.approx(126 + 6 + 20 / 4)  # one drafting: 1/R of a pass
    assert costs.predict_ms(1, 2, 0, drafting=2) == pytest.approx(65 + 6 + 20 / 2)  # drafter pass ∝ R below R = 4
    assert costs.rates(4, 0)[0] == pytest.approx(1000 / (65 + 6))
    assert costs.rates(4, 0, drafting=2)[2] == pytest.approx(1000 / (110 + 6 + 20 / 2))  # half a pass: 2 of R = 4


def test_a_request_alone_reads_the_step_costs_as_the_single_path_reads_its_rounds():
    """alone_rates: the sizes the step can verify, as measured (a CPU curve too: issue #28, B = 2 may cost more than
    B = 3), plus the R = 1 overhead and, when drafting, the drafter's pass. Hand values: ms 80, 100, 96, 120, 200,
    300; B <= 4 reads 80, 100, 96, 120."""
    curve = tiny_sps_curve([80, 100, 96, 120, 200, 300])
    curve.device_type = "cpu"
    costs = StepCosts(curve)
    costs.observe(1, overhead_ms=5.0, draft_ms=10.0)
    assert costs.alone_rates(0, False, 4) == pytest.approx([1000 / 85, 1000 / 105, 1000 / 101, 1000 / 125])
    assert costs.alone_rates(0, True, 2) == pytest.approx([1000 / 95, 1000 / 115])
    assert costs.rates(1, 0)[2] == pytest.approx(1000 / 101)  # a step of several requests reads the row as well
    with pytest.raises(ValueError, match="max_tokens must be in 1..6"):
        costs.alone_rates(0, False, 7)


def test_draft_gate_backs_off_so_re_measures_cost_at_most_the_loss_bound():
    costs = StepCosts(tiny_sps_curve())
    costs.observe(4, overhead_ms=5.0, draft_ms=20.0)  # plain step 115 + 5 = 120 ms; drafting at B = 8: 135 + 25
    gate = DraftGate()
    assert gate.drafts(costs, 4, 0)  # nothing known yet: draft
    gate.observe(4, emitted=5, verified=8)  # t̄ = 1.25, b̄ = 2
    assert gate.model_ratio(costs, 4, 0) == pytest.approx(1.25 * 120 / 160)  # 0.9375: the model against drafting
    assert not gate.drafts(costs, 4, 8) and not gate.drafts(costs, 2, 0)  # no plain rate at R yet: plain measures it
    gate.observe_step(4, 0, emitted=4, step_ms=80.0)
    # a drafting step costs 160 / 120 · (1 − 0.9375) = 1/12 plain step beyond plain decoding: re-measure after
    # ⌈(1/12) / 0.02⌉ = 5 plain steps, then after 10, 20, ..., 320 and 512 (the gate's cap, not a probe's 64)
    assert gate.remeasure_cost(costs, 4, 0) == pytest.approx(1 / 12)
    assert MAX_REMEASURE_INTERVAL == 512
    decisions = [gate.drafts(costs, 4, 0) for _ in range(5 + 10 + 20 + 40 + 80 + 160 + 320 + 512 + 512)]
    assert [i for i, d in enumerate(decisions) if d] == [4, 14, 34, 74, 154, 314, 634, 1146, 1658]
    assert gate.interval == {4: 512}
    gate.observe_step(4, 4, emitted=6, step_ms=150.0)  # measured 0.04 against 0.05 tokens/ms: the measured ratio
    assert gate.remeasure_cost(costs, 4, 0) == pytest.approx(160 / 120 * (1 - 0.8))
    gate.observe_step(4, 2, emitted=5, step_ms=10.0)  # two of four drafted (no room): a rate of neither kind
    assert gate.drafting_rate == {4: 0.04} and gate.plain_rate == {4: 0.05} and gate.streak == {4: 1}


def test_a_re_measure_is_priced_with_the_catch_up_it_would_run_first():
    """The drafter's contexts catch up 4 tokens per plain step (R = 4); at 0.3 ms a token a re-measure after k plain
    steps costs 1/12 + 1.2 k / 120 plain steps: ⌈(1/12 + 0.01 k) / 0.02⌉ ≤ k first at k = 9 (5 without the
    catch-up); at 0.6 ms a token the catch-up alone is 2 % a step, so only the gate's cap (512) bounds the wait."""
    costs = StepCosts(tiny_sps_curve())
    costs.observe(4, overhead_ms=5.0, draft_ms=20.0)  # plain step 120 ms, drafting step 160 ms (as above)
    costs.observe_catch_up(4, ms=0.0, tokens=0)  # nothing caught up: nothing learnt
    assert costs.catch_up_ms == {} and costs.catch_up(4, 40) == 0.0
    costs.observe_catch_up(4, ms=24.0, tokens=40)  # 0.6 ms a token
    costs.observe_catch_up(4, ms=6.0, tokens=40)  # running estimate: 0.8 · 0.6 + 0.2 · 0.15 = 0.51
    assert costs.catch_up_ms == {4: pytest.approx(0.51)} and costs.catch_up(8, 10) == pytest.approx(5.1)
    for per_token, first in ((0.3, 9), (0.6, MAX_REMEASURE_INTERVAL)):
        costs.catch_up_ms = {4: per_token}
        gate = DraftGate()
        gate.observe(4, emitted=5, verified=8)  # model ratio 0.9375: 1/12 plain step beyond plain decoding
        gate.observe_step(4, 0, emitted=4, step_ms=80.0)
        assert gate.remeasure_cost(costs, 4, 0, catch_up=40) == pytest.approx(1 / 12 + 40 * per_token / 120)
        decisions = [gate.drafts(costs, 4, 0, catch_up=4 * k) for k in range(1, MAX_REMEASURE_INTERVAL + 2)]
        assert decisions.index(True) + 1 == first


def test_draft_gate_needs_a_measured_margin_and_two_winning_steps_to_restart():
    costs = StepCosts(tiny_sps_curve())
    costs.observe(4, overhead_ms=5.0, draft_ms=20.0)
    gate = DraftGate()
    gate.observe(4, emitted=8, verified=8)  # t̄ = b̄ = 2: Θ_draft / Θ_plain = 2 · 120 / 160 = 1.5 by the model
    assert not gate.drafts(costs, 4, 0)  # a plain step first, to measure plain decoding at R = 4
    gate.observe_step(4, 0, emitted=4, step_ms=80.0)  # 0.05 tokens/ms
    assert gate.drafts(costs, 4, 0)  # the model for drafting, nothing measured against it
    gate.observe_step(4, 4, emitted=13, step_ms=250.0)  # 0.052 tokens/ms: above plain, but not by 5 %
    decisions = []
    for _ in range(6):  # the engine's loop: decide, then observe the step (rates unchanged)
        decisions.append(gate.drafts(costs, 4, 0))
        gate.observe_step(4, 4 if decisions[-1] else 0, 13 if decisions[-1] else 4, 250.0 if decisions[-1] else 80.0)
    # measured ratio 1.04 ≥ 1: a re-measure costs nothing, so the wait is the interval alone, doubling
    assert decisions == [True, False, True, False, False, False] and gate.interval == {4: 4}
    assert gate.drafts(costs, 4, 0) and gate.interval == {4: 8}  # the next re-measure
    gate.observe_step(4, 4, emitted=26, step_ms=250.0)  # a lucky step: 0.8 · 0.052 + 0.2 · 0.104 = 0.0624 tokens/ms
    assert gate.drafting_rate[4] == pytest.approx(0.0624) and gate.streak[4] == 1
    assert gate.drafts(costs, 4, 0) and gate.interval == {4: 8}  # drafting wins, one step does not restart the clock
    gate.observe_step(4, 4, emitted=26, step_ms=250.0)  # 0.8 · 0.0624 + 0.2 · 0.104 = 0.07072
    assert gate.drafts(costs, 4, 0) and gate.interval == {4: 1}  # two winning steps in a row: back-off restarts
    assert not gate.drafts(costs, 8, 0)  # R = 8: t̄, b̄ from R = 4 (nearest), but no plain rate measured there


def test_a_gate_at_its_cap_re_measures_within_512_steps_and_two_winning_steps_restart_the_clock():
    """At the cap the gate drafts again after 512 plain steps, however much the model now favours drafting (the
    measured rates say it lost); when that re-measure and the next step win, the interval returns to 1."""
    costs = StepCosts(tiny_sps_curve())
    costs.observe(4, overhead_ms=5.0, draft_ms=20.0)  # plain step 120 ms, drafting at B = 8: 160 ms
    gate = DraftGate()
    gate.observe(4, emitted=8, verified=8)  # t̄ = b̄ = 2: 1.5 by the model
    gate.observe_step(4, 0, emitted=4, step_ms=80.0)  # plain: 0.05 tokens/ms
    gate.observe_step(4, 4, emitted=6, step_ms=150.0)  # drafting: 0.04 tokens/ms, it lost
    gate.interval[4], gate.plain_steps[4] = MAX_REMEASURE_INTERVAL, 0  # where steady losses left it
    decisions = []
    for _ in range(MAX_REMEASURE_INTERVAL + 1):  # the engine's loop; a drafting step now emits 26 in 200 ms
        decisions.append(gate.drafts(costs, 4, 0))
        gate.observe_step(4, 4 if decisions[-1] else 0, 26 if decisions[-1] else 4, 200.0 if decisions[-1] else 80.0)
    assert [i for i, d in enumerate(decisions) if d] == [511, 512]  # measured 0.8 · 0.04 + 0.2 · 0.13 = 0.058 > 0.0525
    assert gate.interval == {4: 512}  # the re-measure and one win: not yet
    assert gate.drafts(costs, 4, 0) and gate.interval == {4: 1}  # two winning steps in a row: back-off restarts


class FrozenCosts(StepCosts):
    """Step costs set by hand that learn nothing from the timed steps, so a test can derive every plan."""

    def observe(self, requests, overhead_ms, draft_ms=None):
        pass


def drafted_with_confidence(monkeypatch, drafter, confidence):
    """Every block the drafter drafts (its tokens unchanged) carries ``confidence`` at every position."""
    draft_many = type(drafter).draft_many

    def drafted(self, *args, **kwargs):
        blocks = draft_many(self, *args, **kwargs)
        for block in blocks:
            block.confidences = torch.full_like(block.confidences, confidence)
        return blocks

    monkeypatch.setattr(type(drafter), "draft_many", drafted)


@pytest.mark.parametrize("mode", ["scheduler", "async"])
def test_a_request_alone_in_flight_is_planned_as_the_single_request_path_plans(target, drafter, monkeypatch, mode):
    """R = 1 without prompt lookup: the single-request path's round planner decides whether a step drafts; the gate
    is never asked. Steps
    cost 5 ms beyond the verification (65 ms at B = 1, 80 at B = 2), the drafter pass nothing, and every draft
    carries confidence 0.1: DSpark's Θ(ℓ = 1) = 1.1 · 1000 / 85 = 12.9 against the target alone's 1000 / 70 = 14.3.
    The first step drafts (no estimate yet; Algorithm 1 verifies none of it), then the target verifies alone and a
    probe drafts once the estimate is older than its price allows: a probe loses 85 / 70 - 1.1 = 0.114 plain steps,
    so it waits ceil(0.114 / 1 %) = 12 steps (more than the 4 of the interval), then 24 (the interval doubles; the
    price, 13 after the correction's 0.1 expected, stays below); a probe verifies one draft, and the online
    correction hears from each. The output is plain `generate`'s."""
    curve = tiny_sps_curve([65, 80, *CPU_MS[2:]])  # not the drafter's: a test before may have given it a curve
    costs, gate = FrozenCosts(curve, overhead_ms={1: 5.0}), ScriptedGate()
    monkeypatch.setattr("dspark_hf.decoding.concurrent.learnt_costs", lambda *args: (costs, gate))
    drafted_with_confidence(monkeypatch, drafter, 0.1)
    decoder = ConcurrentDecoder(target, drafter, verification=mode, max_requests=1, sps=curve, lookup=False)
    request = decoder.add(PROMPTS[2], 44)
    with decoder.running():
        while decoder.active:
            decoder.step()
    steps = [s for s in decoder.stats.steps if not s.prefill]
    assert [s.drafted for s in steps[:39]] == [1] + [0] * 12 + [1] + [0] * 24 + [1]
    assert [s.lengths for s in steps[:39] if s.drafted] == [[0], [1], [1]]
    assert gate.calls == 0
    assert request.planner.correction.expected == pytest.approx(0.2)  # two probes reached their one draft
    assert request.generated == plain(target, PROMPTS[2], max_new=44)


@pytest.mark.parametrize("mode", ["scheduler", "async"])
def test_a_requests_length_is_planned_on_its_online_corrected_confidences(target, drafter, monkeypatch, mode):
    """ℓ reads the request's own online-corrected confidences, as the single-request path plans ℓ. Steps cost 5 ms
    beyond the verification (70, 114, 115, 120, 125 ms at B = 1..5), every draft has confidence 0.9 (STS at T = 1
    keeps it). Uncorrected, Algorithm 1 admits all four drafts: Θ = 1.9 · 1000 / 114 = 16.7, 2.71 / 0.115 = 23.6,
    3.44 / 0.120 = 28.7, 4.10 / 0.125 = 32.8 against 1000 / 70 = 14.3 alone. The request's correction set to
    f = (1 + 2) / (4 + 2) = 0.5 makes them 0.45: Θ(ℓ = 1) = 1.45 · 1000 / 114 = 12.7 < 14.3, so ℓ = 0. With a second
    request, not corrected, in the step (R = 2, from 2 · 1000 / 114 = 17.5; 131, 135, 140 ms at B = 6..8): its four
    drafts go first (Θ up to 5.10 / 0.131 = 38.9), then the corrected 0.45 (5.55 / 0.135 = 41.1), then not 0.45² =
    0.2025 (5.75 / 0.140 = 41.05): ℓ = [1, 4], where uncorrected confidences would give [4, 4] (the correction is
    per request)."""
    curve = tiny_sps_curve()
    costs = FrozenCosts(curve, overhead_ms={1: 5.0, 2: 5.0}, draft_ms={1: 0.0, 2: 0.0})
    monkeypatch.setattr("dspark_hf.decoding.concurrent.learnt_costs", lambda *args: (costs, ScriptedGate()))
    drafted_with_confidence(monkeypatch, drafter, 0.9)
    first_lengths = []
    for requests in (1, 2):
        decoder = ConcurrentDecoder(target, drafter, verification=mode, max_requests=requests, sps=curve)
        corrected = decoder.add(PROMPTS[2], 12)
        others = [decoder.add(PROMPTS[3], 12) for _ in range(requests - 1)]
        corrected.planner.correction.accepted, corrected.planner.correction.expected = 1, 4.0  # f = 0.5
        with decoder.running():
            while decoder.active:
                decoder.step()
        first_lengths.append(next(s.lengths for s in decoder.stats.steps if not s.prefill and s.drafted))
        for request in [corrected, *others]:
            assert request.generated == plain(target, request.ids[:request.prompt_length], max_new=12)
    assert first_lengths == [[0], [1, 4]]


# ----------------------------------------------------------------- a request alone in flight: prompt lookup
# Alone in flight, a request's step is the single-request path's round (dspark_hf.decoding.alone): a lookup
# continuation (no drafter pass), a hybrid (lookup tokens forced as the block's first drafts), DSpark or the target.
LOOKUP_COSTS = dict(overhead_ms={1: 5.0, 2: 5.0}, draft_ms={1: 10.0, 2: 10.0})  # beyond the tiny curve (ms)


def round_source(r):
    """What a recorded step proposed: ``lookup`` (no confidences: no drafter pass), ``hybrid``, ``dspark``, ``target``."""
    if r.lookup:
        return "hybrid" if r.confidences else "lookup"
    return "dspark" if r.drafted else "target"


def alone_planner(lookup, dspark):
    """A planner whose lookup tokens are worth ``lookup = (first token, later ones)`` (its prior means, no data yet)
    and whose DSpark estimate is the calibrated block ``dspark`` (correction f = 1)."""
    planner = AlonePlanner(None, OnlineCorrection(), LookupPrior)
    planner.acceptance = LookupAcceptance(prior=LookupPrior())
    planner.acceptance.prior_means = dict(zip((True, False), lookup))
    planner.block_estimate = list(dspark)
    return planner


def test_a_request_alone_plans_lookup_hybrid_dspark_or_the_target_by_theta():
    """Hand values. Steps cost 5 ms beyond the tiny curve, the drafter's pass 10 ms more: Θ(ℓ) = (1 + Σ a_j) · rate,
    rates without the drafter 1000 / (70, 114, 115, 120) and with it 1000 / (80, 124, 125, 130) at B = 1..4; the
    target alone 1000 / 70 = 14.29 (to beat by 5 %: 15.0). Text [5, 6, 7, 8, 5, 6]: the anchor 6 ends "5 6", seen at
    the start, so the continuation is (7, 8, 5) with 3 tokens of room (γ = 3).

    * lookup (0.9, 0.9), DSpark 0.9 each: lookup ℓ = 3, Θ = (1 + .9 + .81 + .729) · 1000 / 120 = 28.66; DSpark and every
      hybrid read the same survivals at the drafter's rates (3.439 · 1000 / 130 = 26.45);
    * lookup (0.5, 0.5), DSpark 0.9: DSpark (26.45 against lookup's 1.875 · 1000 / 120 = 15.63 and the best hybrid,
      k = 1: (1 + .5 + .45 + .405) · 1000 / 130 = 18.12);
    * lookup (0.9, 0.3), DSpark (0.2, 0.95, 0.95): hybrid k = 1, ℓ = 3, Θ = (1 + .9 + .855 + .81225) · 1000 / 130 =
      27.44 (lookup alone 2.17 · 1000 / 115 = 18.87; DSpark at best ℓ = 0, 12.5; k = 2: 2.4265 · 1000 / 130 = 18.67);
    * lookup (0.3, 0.3), DSpark 0.1: the target alone (every proposal's Θ below 15.0: lookup 1.39 · 1000 / 115 = 12.09,
      DSpark's ℓ = 0 at the drafter's rate 12.5)."""
    costs = FrozenCosts(tiny_sps_curve(), **LOOKUP_COSTS)
    ids = [5, 6, 7, 8, 5, 6]
    cases = [((0.9, 0.9), [0.9] * 3, ("lookup", (7, 8, 5), 3, 3.439 * 1000 / 120)),
             ((0.5, 0.5), [0.9] * 3, ("dspark", (), None, 3.439 * 1000 / 130)),
             ((0.9, 0.3), [0.2, 0.95, 0.95], ("hybrid", (7,), 3, 3.56725 * 1000 / 130)),
             ((0.3, 0.3), [0.1] * 3, ("target", (), 0, 1000 / 70))]
    for lookup, dspark, (source, tokens, length, theta) in cases:
        plan = alone_planner(lookup, dspark).plan(ids, costs, context=5, gamma=3, room=3)
        assert (plan.source, plan.lookup_tokens, plan.length) == (source, tokens, length), (lookup, dspark, plan)
        assert plan.theta == pytest.approx(theta, rel=1e-9)


@pytest.mark.parametrize("mode", ["scheduler", "async"])
def test_a_request_alone_with_lookup_steps_equals_plain_generate(target, drafter, monkeypatch, mode):
    """R = 1 on prompts holding a stretch of the cycle (some with every 2nd, 3rd or 4th token of it wrong), the
    drafter's pass free (steps cost 5 ms beyond the tiny curve): lookup, hybrid, DSpark and target steps all run and the
    output equals plain greedy ``generate``. Replayed from the output step by step: each step's leading lookup tokens
    are the continuation of the text accepted before it (so a hybrid's block starts with them), the lookup estimate
    scored every planned continuation against what the step produced, and the online correction heard from the
    drafter's own verified drafts only (after a hybrid's forced tokens)."""
    costs = FrozenCosts(tiny_sps_curve(), overhead_ms={1: 5.0}, draft_ms={1: 0.0})
    monkeypatch.setattr("dspark_hf.decoding.concurrent.learnt_costs", lambda *args: (costs, ScriptedGate()))
    g = torch.Generator().manual_seed(14)
    sources = []
    for trap in (0, 3, 4, 2):
        prompt = cycle_prompt(g, trap_every=trap)[0].tolist()
        decoder = ConcurrentDecoder(target, drafter, verification=mode, max_requests=1, sps=costs.sps)
        request, acceptance, correction = decoder.add(prompt, 24), LookupAcceptance(), OnlineCorrection()
        with decoder.running():
            decoder.step()  # the prefill
            while decoder.active:
                done = len(request.generated)
                decoder.step()
                r, room = request.stats.rounds[-1], 24 - done - 1  # room: draft tokens the budget left
                match = find_continuation(prompt + request.generated[:done], min(16, costs.sps.max_tokens - 1, room))
                if match is not None:
                    acceptance.update(match, request.generated[done:done + r.accepted + 1])
                assert r.draft_tokens[:r.lookup] == list(match.tokens[:r.lookup] if r.lookup else ()), (done, r)
                if r.confidences:
                    correction.observe_round(r.confidences, r.lookup, r.scheduled, r.accepted)  # STS at T = 1
                if not request.done:  # (the last step's drafts may be cut by the budget)
                    assert (request.planner.acceptance.accepted, request.planner.acceptance.rejected) == (
                        acceptance.accepted, acceptance.rejected)
                    assert request.planner.correction.expected == pytest.approx(correction.expected)
                    assert request.planner.correction.accepted == correction.accepted
                sources.append(round_source(r))
        assert request.generated == plain(target, prompt, max_new=24)
    assert {"lookup", "hybrid", "dspark", "target"} <= set(sources), sources


@pytest.mark.parametrize("mode", ["scheduler", "async"])
def test_sampling_is_exact_for_a_request_alone_with_lookup_proposals(sampling_rows, monkeypatch, mode):
    """R = 1, 4 new tokens, the step after the prefill planned by coin flips drawn independently of every draft
    (test_generation's: lookup, hybrid, DSpark or the target; the real continuation when the text has one, else
    random tokens): (t1, t2), (t2, t3), t2 and t3 follow the target's law; lookup tokens were both accepted and
    rejected. A lookup token always accepted (its q zero) fails it; a uniform q instead of the one-hot one is biased
    too, but with random lookup tokens the bias averages out (t2: p ≈ 2e-3 at 400 samples, 2e-2 at 600)."""
    target, prompts, laws = sampling_rows
    drafter = sampling_drafter(target)
    flip, plan = coin_flip_plan(7), AlonePlanner.plan

    def coin_flips(self, ids, costs, context, gamma, room):
        if gamma < 1:  # one token left: not planned
            return plan(self, ids, costs, context, gamma, room)
        self.max_tokens = room  # read by the coin flips' lookup
        return flip(self, torch.tensor([ids]), gamma, room)

    monkeypatch.setattr(AlonePlanner, "plan", coin_flips)
    n, tables, sources = 400, (torch.zeros(SV, SV), torch.zeros(SV, SV)), []
    torch.manual_seed(2024)
    for _ in range(n):
        outputs, stats = generate_concurrent(target, drafter, [prompts[0]], max_concurrency=1, max_new_tokens=4,
                                             verification=mode, do_sample=True, block_size=4, eos_token_ids=())
        t = outputs[0]
        tables[0][t[0], t[1]] += 1
        tables[1][t[1], t[2]] += 1
        first = stats[0].rounds[0]
        sources.append((round_source(first), first.accepted >= 1))
    # the marginals too: a lookup proposal's bias sits in one token of t2, diluted in the 64 cells of (t1, t2)
    for counts, law in (*zip(tables, laws[0]), (tables[0].sum(0), laws[0][0].sum(0)), (tables[1].sum(0), laws[0][1].sum(0))):
        x2, df, p = chi_square(counts, law.float(), n)
        assert p > 1e-3, (mode, x2, df, p)
    for source in ("lookup", "hybrid"):
        assert (source, True) in sources and (source, False) in sources, sources


def test_a_fixed_lookup_token_is_accepted_with_the_targets_probability(sampling_rows, monkeypatch):
    """R = 1, 3 new tokens, the step after the prefill always proposes lookup token 2 alone (one-hot q): t2 follows the
    target's law. The random tokens of the coin-flip test average a wrong q's bias out; a fixed token does not (a
    uniform q accepts it with probability min(1, 8 · p(2)) instead of p(2))."""
    target, prompts, laws = sampling_rows
    monkeypatch.setattr(AlonePlanner, "plan", lambda self, ids, costs, context, gamma, room: RoundPlan(
        "lookup", (LEAK_TOKEN,), 1) if gamma >= 1 else RoundPlan("target", (), 0))
    drafter, n, counts = sampling_drafter(target), 200, torch.zeros(SV)
    torch.manual_seed(7)
    for _ in range(n):
        outputs, stats = generate_concurrent(target, drafter, [prompts[0]], max_concurrency=1, max_new_tokens=3,
                                             verification="scheduler", do_sample=True, block_size=4, eos_token_ids=())
        counts[outputs[0][1]] += 1
        assert stats[0].rounds[0].draft_tokens == [LEAK_TOKEN] and not stats[0].rounds[0].confidences
    x2, df, p = chi_square(counts, laws[0][0].sum(0).float(), n)
    assert p > 1e-3, (x2, df, p)


def test_requests_in_flight_together_plan_no_lookup(target, drafter, monkeypatch):
    """R = 2, one prompt twice with the same budget (greedy: the two finish at the same step, never one alone): every
    step is the gate's (ScriptedGate drafts 2 steps of 3), no step proposes lookup tokens, each output is plain greedy
    ``generate``'s; ``lookup=False`` keeps lookup off for a request alone. The step costs are frozen and every draft
    carries confidence 0.99: costs learnt from this machine's timings, or a batch schedule that splits one more token
    between two requests with equal estimates, could give the two requests different ℓ, and then one of them finishes
    alone."""
    monkeypatch.setattr("dspark_hf.decoding.concurrent.learnt_costs", lambda drafter, curve, settings: (
        FrozenCosts(tiny_sps_curve()), ScriptedGate()))
    drafted_with_confidence(monkeypatch, drafter, 0.99)
    prompts = [cycle_prompt(torch.Generator().manual_seed(14))[0].tolist()] * 2
    outputs, stats = generate_concurrent(target, drafter, prompts, max_concurrency=2, max_new_tokens=12,
                                         verification="scheduler", eos_token_ids=())
    assert outputs == [plain(target, p, max_new=12) for p in prompts]
    steps = [s for s in stats.steps if not s.prefill]
    assert all(s.requests == 2 for s in steps) and [s.drafted for s in steps[:6]] == [2, 2, 0, 2, 2, 0]
    assert all(r.lookup == 0 for row in stats.rows for r in row.rounds)
    _, alone = generate_concurrent(target, drafter, prompts[:1], max_concurrency=1, max_new_tokens=12,
                                   verification="scheduler", lookup=False)
    assert all(r.lookup == 0 for r in alone[0].rounds)


def test_the_gate_hears_what_a_drafting_step_would_catch_up_and_the_costs_learn_its_price(target, drafter,
                                                                                          monkeypatch):
    """The engine tells the gate the tokens a drafting step would first add to the drafter's contexts: both prompts
    (the first drafting step), nothing after a drafting step (its own extension is drafting), and after a plain step
    the features of the two steps since the last drafts; the cost model learns ms per such token at R = 2."""
    costs, gate = FrozenCosts(tiny_sps_curve()), ScriptedGate()
    monkeypatch.setattr("dspark_hf.decoding.concurrent.learnt_costs", lambda drafter, curve, settings: (costs, gate))
    prompts = [cycle_prompt(torch.Generator().manual_seed(14))[0].tolist()] * 2
    _, stats = generate_concurrent(target, drafter, prompts, max_concurrency=2, max_new_tokens=12,
                                   verification="scheduler", eos_token_ids=())
    second = stats.rows[0].rounds[1]  # the second step drafted, then a plain step (ScriptedGate: 2 of 3)
    assert gate.catch_ups[:4] == [2 * len(prompts[0]), 0, 0, 2 * ((1 + second.accepted) + 1)]
    assert list(costs.catch_up_ms) == [2] and costs.catch_up_ms[2] > 0


def test_learnt_costs_carry_over_between_calls_with_the_same_settings(drafter):
    curve = tiny_sps_curve()
    costs, gate = learnt_costs(drafter, curve, (4, "scheduler", False))
    costs.observe(2, overhead_ms=3.0, draft_ms=9.0)
    gate.observe(2, emitted=5, verified=6)
    assert learnt_costs(drafter, curve, (4, "scheduler", False)) == (costs, gate)
    assert learnt_costs(drafter, curve, (4, "async", False))[1].tokens_per_request == {}  # other settings: afresh
    assert learnt_costs(drafter, tiny_sps_curve(), (4, "scheduler", False))[0].draft_ms == {}  # a new curve too


def test_concurrency_bench_rows(target, drafter, tmp_path):
    lines = []
    result = run_concurrency(target, drafter, [[3, 5, 7], [9]], [1, 2], max_new_tokens=4, gamma=4,
                             arms=("plain", "fixed", "best_fixed"), log=lines.append, fixed_ks=(1, 4), repeats=2)
    assert [(r["concurrency"], r["arm"]) for r in result["rows"]] == [
        (1, "plain"), (1, "fixed"), (1, "best_fixed"), (2, "plain"), (2, "fixed"), (2, "best_fixed")]
    # the loops interleave, the second repetition in reverse order (plain before and after the others); fixed
    # γ = 4 runs once per repetition for both arms
    runs = [line.split(": ")[0] for line in lines if " run " in line]
    assert runs[:6] == ["R=1 run 1/2 plain", "R=1 run 1/2 fixed k=4", "R=1 run 1/2 fixed k=1",
                        "R=1 run 2/2 fixed k=1", "R=1 run 2/2 fixed k=4", "R=1 run 2/2 plain"]
    assert all(r["mismatches"] == 0 and r["tokens"] == 4 * r["requests"] for r in result["rows"])
    for plain, fixed, best in zip(result["rows"][0::3], result["rows"][1::3], result["rows"][2::3]):
        for row in (plain, fixed, best):  # each arm: its fastest run, against plain's fastest and run by run
            assert len(row["tok_s_runs"]) == 2 and row["aggregate_tok_s"] == max(row["tok_s_runs"])
            assert row["speed_vs_plain"] == row["aggregate_tok_s"] / plain["aggregate_tok_s"]
            assert row["speed_vs_plain_paired"] == [a / p for a, p in zip(row["tok_s_runs"], plain["tok_s_runs"])]
        assert set(best["tok_s_by_k"]) == {"1", "4"}
        assert best["tok_s_by_k"]["4"] == fixed["aggregate_tok_s"]  # fixed γ = 4 is reused, not run again
        assert best["aggregate_tok_s"] == max(best["tok_s_by_k"].values())
        assert best["tok_s_by_k"][str(best["k"])] == best["aggregate_tok_s"]
    table = markdown(result)
    assert f"| 1 | best_fixed (k = {result['rows'][2]['k']}) |" in table
    assert "every arm ran 2 times per R" in table and "fixed k of 1, 4 at this R" in table  # the legend
    assert {p.name for p in write(result, tmp_path)} == {"concurrency.json", "concurrency.md",
                                                         "concurrency_frontier.png", "concurrency_budget.png"}


