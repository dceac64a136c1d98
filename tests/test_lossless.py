"""Lossless under every option of ``generate``, or a clear error before any compute (issue 15).

* Stop strings and custom stopping criteria under sampling: the exact probability of stopping at each
  position, computed by enumeration, against DSpark's frequencies (chi-square and a binomial z).
* No admission decision looks at a stop string: every round of ``fixed`` mode verifies all γ drafts.
* Statistics: every generated token belongs to the prefill or to exactly one round.
* transformers' assistant options: honoured (``num_assistant_tokens`` is γ) or rejected naming the fix;
  ``dspark_*`` settings without a DSpark drafter are rejected.
* Targets: an int8 lm_head is refused at bind; int8 decoder layers work; bfloat16 keeps what the README
  promises; ``inference_mode``, ``no_grad`` and the ``text-generation`` pipeline work on the first call.
* Issue 25: stateful logits processors (classifier-free guidance, SynthID) are refused before any compute; a
  pre-filled cache (40 or 10 of 45 prompt tokens, a chat's second turn) gives plain generate's output; in bf16 and
  fp16 the q each draft is sampled from is the q speculative sampling divides by.
"""

import copy
import re
import sys

import pytest
import torch
from conftest import CYCLE_VOCAB, cycle_target, tiny_llama
from test_generation import (
    SV,
    CollectingStreamer,
    assert_greedy_identical,
    char_tokenizer,
    check_stats,
    chi_square,
    ready_cycle_drafter,
    sampling_drafter,
    threshold_of,
)
from tokenizers import Tokenizer, decoders, models
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    StoppingCriteria,
    StoppingCriteriaList,
    SynthIDTextWatermarkingConfig,
    WatermarkingConfig,
    pipeline,
)
from transformers.generation import utils as generation_utils
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

import dspark_hf  # noqa: F401  (routes DSpark drafters through DSparkCandidateGenerator)
from dspark_hf import DSparkConfig, DSparkDrafter, prepack_linears
from dspark_hf.modeling import drafting

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 12


@pytest.fixture(scope="module")
def target():
    return cycle_target(num_hidden_layers=1, alpha=0.026)


@pytest.fixture(scope="module")
def drafter(target):
    return ready_cycle_drafter(target, "markov")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, CYCLE_VOCAB, (1, n), generator=g) for n in (1, 3, 5, 2, 7, 4, 6, 3)]


@pytest.fixture(scope="module")
def references(target, prompts):
    return [target.generate(p, max_new_tokens=MAX_NEW, do_sample=False) for p in prompts]


def dspark(target, prompt, drafter, mode="fixed", gamma=7, max_new=MAX_NEW, **kwargs):
    return target.generate(prompt, max_new_tokens=max_new, do_sample=False, assistant_model=drafter,
                           dspark_verification=mode, dspark_block_size=gamma, **threshold_of(mode, 0.5), **kwargs)


# ---------------------------------------------------------------------- 1. stop strings, sampling
# The sampling target of test_generation (vocabulary 8) with a character tokenizer "abcdefgh". Prompt "aae",
# stop string "a", max_new_tokens=3: t1 comes from the prefill, one round drafts t2 (γ capped at 1 by the budget),
# t3 is that round's bonus or a last round's token. Outcome = where the output stops: after t1, t2, t3 or not at all.
# Exact law by enumerating the 8^3 continuations with the target's softmax (float64).
# Bound: Pearson chi-square over the 4 outcomes, p > 1e-3, and a binomial z for P(stop at t2) within ±3.29
# (two-sided 1e-3), N = 400 (seeds fixed). Today's main (ℓ shortened when a draft completes a stop string) gives
# P(stop at t2) ≈ 0.05 for an exact 0.140 (measured: z ≈ -4.5 at N = 300, ≈ -5 expected at N = 400).
STOP_CHARS = "abcdefgh"
STOP = "a"
STOP_NEW = 3
STOP_SAMPLES = 400
Z_BOUND = 3.29
P_MIN = 1e-3


def stop_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(STOP_CHARS)}, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def stop_position(ids: list[int], prompt_len: int, stop: str) -> int:
    """1-based new-token index after which plain ``generate`` stops on ``stop``; 0 when it never does."""
    text = "".join(STOP_CHARS[t] for t in ids)
    return next((k for k in range(1, len(ids) - prompt_len + 1) if text[: prompt_len + k].endswith(stop)), 0)


def exact_stop_law(target, prompt, stop, max_new) -> torch.Tensor:
    """``[max_new + 1]`` float64: P(stop after new token k) for k = 1..max_new, then P(no stop)."""
    seqs, log_p = prompt.clone(), torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(max_new):
            p = target(seqs).logits[:, -1].double().softmax(-1)  # [n, SV]
            seqs = torch.cat([seqs.repeat_interleave(SV, 0), torch.arange(SV).repeat(seqs.shape[0])[:, None]], 1)
            log_p = (log_p[:, None] + p.log()).reshape(-1)
    law = torch.zeros(max_new + 1, dtype=torch.float64)
    for ids, prob in zip(seqs.tolist(), log_p.exp().tolist()):
        k = stop_position(ids, prompt.shape[1], stop)
        law[k - 1 if k else max_new] += prob
    return law


@pytest.fixture(scope="module")
def stop_setup():
    target = tiny_llama(SV, 16, 1, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                        pad_token_id=None, initializer_range=0.3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)
    prompt = torch.tensor([[0, 0, 4]])
    return target, prompt, exact_stop_law(target, prompt, STOP, STOP_NEW)


@pytest.mark.parametrize("mode", ["fixed", "scheduler"])
def test_sampling_with_stop_strings_is_exact(stop_setup, mode):
    target, prompt, law = stop_setup
    drafter, tok = sampling_drafter(target), stop_tokenizer()
    counts = torch.zeros(STOP_NEW + 1)
    torch.manual_seed(0)
    for _ in range(STOP_SAMPLES):
        out = target.generate(prompt, max_new_tokens=STOP_NEW, do_sample=True, top_k=None, assistant_model=drafter,
                              dspark_verification=mode, stop_strings=[STOP], tokenizer=tok)
        k = stop_position(out[0].tolist(), prompt.shape[1], STOP)
        assert k in (0, out.shape[1] - prompt.shape[1]), f"output runs past its stop string: {out}"
        counts[k - 1 if k else STOP_NEW] += 1
        assert drafter.last_stats.new_tokens == out.shape[1] - prompt.shape[1]
    x2, df, p = chi_square(counts, law, STOP_SAMPLES)
    assert p > P_MIN, f"{mode}: stop positions {counts.tolist()} vs exact {law.tolist()}: X²={x2:.1f} on {df} df"
    freq, exact = counts[1] / STOP_SAMPLES, float(law[1])
    z = (freq - exact) / (exact * (1 - exact) / STOP_SAMPLES) ** 0.5
    assert abs(z) < Z_BOUND, f"{mode}: P(stop at token 2) = {freq:.3f}, exact {exact:.3f} (z = {z:.2f})"


# ---------------------------------------------------------------------- 1. stop strings, greedy
def stop_cases(prompts, references, tok):
    """(prompt, two-character stop string completed at the 5th new token, plain output without stop)."""
    for prompt, full in zip(prompts, references):
        n = prompt.shape[1]
        yield prompt, tok.decode(full[0, n + 3:n + 5]), full


def test_stop_strings_never_shorten_the_verified_block(target, drafter, prompts, references):
    """Fixed mode verifies all γ drafts whatever they are; the output is cut at the stop, as plain generate stops."""
    tok = char_tokenizer()
    cut_inside_a_block = 0
    for prompt, stop, full in stop_cases(prompts, references, tok):
        n = prompt.shape[1]
        ref = target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, stop_strings=[stop], tokenizer=tok)
        out = dspark(target, prompt, drafter, stop_strings=[stop], tokenizer=tok)
        assert_greedy_identical(target, out, ref, f"stop {stop!r}")
        check_stats(drafter, out, n, MAX_NEW, 7, "fixed")
        rounds = drafter.last_stats.rounds
        assert all(r.scheduled == r.drafted for r in rounds), [(r.drafted, r.scheduled) for r in rounds]
        last = rounds[-1]
        start = out.shape[1] - (last.accepted + 1)
        drafts = torch.tensor(last.draft_tokens[: last.scheduled], dtype=torch.long)
        continuation = full[0, start:start + drafts.numel()]
        matched = int((drafts[: continuation.numel()] == continuation).int().cumprod(0).sum())
        cut_inside_a_block += matched > last.accepted  # the target accepted drafts beyond the stop: they were cut
    assert cut_inside_a_block >= 2, "no stop string completed inside an accepted block: the cut was not exercised"


class StopAfterToken(StoppingCriteria):
    """Stops once the last token is ``token`` (a user criterion transformers checks once per assisted round)."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_see_every_token(target, drafter, prompts, references):
    for prompt, full in zip(prompts, references):
        n = prompt.shape[1]
        criteria = StoppingCriteriaList([StopAfterToken(int(full[0, n + 4]))])
        ref = target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, stopping_criteria=criteria)
        out = dspark(target, prompt, drafter, stopping_criteria=criteria)
        assert_greedy_identical(target, out, ref, "custom criterion")
        check_stats(drafter, out, n, MAX_NEW, 7, "fixed")


@pytest.mark.parametrize("with_scores", [False, True])
def test_streamer_and_outputs_are_cut_at_the_stop(target, drafter, prompts, references, with_scores):
    """The streamer gets exactly the returned tokens (judged on arrival, or one round later when scores are kept)."""
    tok = char_tokenizer()
    for prompt, stop, _ in stop_cases(prompts[:5], references[:5], tok):
        n = prompt.shape[1]
        streamer = CollectingStreamer()
        extra = dict(return_dict_in_generate=True, output_scores=True, output_logits=True) if with_scores else {}
        result = dspark(target, prompt, drafter, stop_strings=[stop], tokenizer=tok, streamer=streamer, **extra)
        out = result.sequences if with_scores else result
        assert tok.decode(out[0, n:]).endswith(stop) and stop not in tok.decode(out[0, n:-1])
        assert torch.equal(torch.cat(streamer.chunks[1:]), out[0, n:]) and streamer.ended == 1
        if with_scores:
            assert len(result.scores) == len(result.logits) == out.shape[1] - n
            assert torch.equal(torch.stack([s[0].argmax() for s in result.scores]), out[0, n:])
            assert result.cache.get_seq_length() == out.shape[1] - 1


# ------------------------------------------------------------------------------- 5. statistics
@pytest.mark.parametrize("mode", ["fixed", "threshold"])
def test_every_token_belongs_to_exactly_one_round(target, drafter, prompts, mode):
    """Budgets that end with no room for a draft record that last verification (a round with γ = 0)."""
    seen_empty_last_round = 0
    for max_new in range(1, 20):
        prompt = prompts[max_new % len(prompts)]
        out = dspark(target, prompt, drafter, mode, gamma=4, max_new=max_new)
        stats = drafter.last_stats
        assert out.shape[1] - prompt.shape[1] == max_new == stats.new_tokens == 1 + sum(r.accepted + 1 for r in stats.rounds)
        check_stats(drafter, out, prompt.shape[1], max_new, 4, mode, threshold=0.5)
        seen_empty_last_round += bool(stats.rounds) and stats.rounds[-1].drafted == 0
    assert seen_empty_last_round >= 3


# --------------------------------------------------------------------------- 2. generate options
@pytest.mark.parametrize(("option", "fix"), [
    ({"num_assistant_tokens_schedule": "heuristic"}, "dspark_verification='scheduler'"),
    ({"assistant_confidence_threshold": 0.7}, "dspark_threshold"),
    ({"prompt_lookup_num_tokens": 3}, "prompt lookup"),
    ({"assistant_early_exit": 1}, "assistant_early_exit"),
    ({"assistant_ensemble_weight": 0.5}, "not lossless"),
])
def test_unsupported_assistant_options_raise_before_compute(target, drafter, prompts, forward_calls, option, fix):
    with pytest.raises(ValueError, match=re.escape(fix)):
        dspark(target, prompts[1], drafter, **option)
    assert not forward_calls, "the target ran before the error"


def test_num_assistant_tokens_is_gamma(target, drafter, prompts, references, forward_calls):
    out = target.generate(prompts[2], max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter,
                          dspark_verification="fixed", num_assistant_tokens=3)
    assert_greedy_identical(target, out, references[2], "num_assistant_tokens")
    assert max(r.drafted for r in drafter.last_stats.rounds) == 3
    forward_calls.clear()
    with pytest.raises(ValueError, match="disagree"):
        dspark(target, prompts[2], drafter, gamma=4, num_assistant_tokens=3)
    assert not forward_calls


@pytest.mark.parametrize("gamma", [2.7, True, "4"])
def test_block_size_must_be_an_integer(target, drafter, prompts, forward_calls, gamma):
    with pytest.raises(ValueError, match="dspark_block_size.*integer"):
        dspark(target, prompts[1], drafter, gamma=gamma)
    assert not forward_calls


@pytest.mark.parametrize("threshold", ["0.5", True, 1.5])
def test_threshold_must_be_a_number_in_the_unit_interval(target, drafter, prompts, forward_calls, threshold):
    """A new user's trial: dspark_threshold="0.5" was accepted (float() of the string) where dspark_block_size="4" is
    refused."""
    with pytest.raises(ValueError, match=r"dspark_threshold must be a (number|probability) in \[0, 1\]"):
        target.generate(prompts[1], max_new_tokens=4, do_sample=False, assistant_model=drafter,
                        dspark_verification="threshold", dspark_block_size=4, dspark_threshold=threshold)
    assert not forward_calls


@pytest.mark.parametrize("setting", [{"dspark_verification": "bogus"}, {"dspark_block_size": 4},
                                     {"dspark_threshold": 0.3}])
def test_dspark_settings_without_a_dspark_drafter_raise(target, prompts, forward_calls, setting):
    with pytest.raises(ValueError, match=f"^{next(iter(setting))} needs a DSpark drafter"):
        target.generate(prompts[1], max_new_tokens=4, do_sample=False, **setting)
    with pytest.raises(ValueError, match="needs a DSpark drafter"):
        target.generate(prompts[1], max_new_tokens=4, do_sample=False, assistant_model=tiny_llama(CYCLE_VOCAB, 32, 1),
                        **setting)
    assert not forward_calls


def test_a_drafter_passed_by_name_raises_naming_the_loader(target, prompts, forward_calls, tmp_path):
    """A new user's trial: assistant_model="drafters/..." failed in transformers with "'str' object has no attribute
    'config'"."""
    for name in ("drafters/dspark-smollm2-135m-instruct", tmp_path):
        with pytest.raises(ValueError, match=r"assistant_model must be a loaded model.*DSparkDrafter.from_pretrained"):
            target.generate(prompts[1], max_new_tokens=4, do_sample=False, assistant_model=name)
    assert not forward_calls


# ------------------------------------------------------------------------------------ 2. targets
def test_quantized_lm_head_is_refused_at_bind(target, prompts, forward_calls):
    quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(target), {torch.nn.Linear}, dtype=torch.qint8)
    drafter = ready_cycle_drafter(target, "markov")
    with pytest.raises(TypeError, match="lm_head.*floating-point"):
        drafter.bind(quantized)
    with pytest.raises(TypeError, match="lm_head"):
        dspark(quantized, prompts[1], drafter)
    assert not drafter.is_bound


def test_dynamically_quantized_layers_are_refused(target, prompts):
    """int8 dynamic quantization of the layers only: one activation scale per forward makes a token's logits
    depend on the other tokens verified with it (seen here: greedy diverges at a top-2 gap of 0.026, far
    above float rounding), so bind refuses it instead of silently losing losslessness."""
    quantized = torch.ao.quantization.quantize_dynamic(
        copy.deepcopy(target), {"model.layers": torch.ao.quantization.default_dynamic_qconfig}, dtype=torch.qint8)
    ids = torch.cat([prompts[4], references_of(target, prompts[4])], dim=-1)
    with torch.no_grad():  # the premise: the logits of a position change with the tokens after it
        alone = quantized(ids[:, :6]).logits[0, -1]
        with_more = quantized(ids).logits[0, 5]
    assert not torch.allclose(alone, with_more, atol=1e-4)
    with pytest.raises(TypeError, match="dynamically quantized.*not be lossless"):
        dspark(quantized, prompts[1], ready_cycle_drafter(target, "markov"))


def references_of(target, prompt):
    return target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)[:, prompt.shape[1]:]


# bfloat16 (README, "What is guaranteed"): every emitted token is the target's argmax in the verification
# forward, and an output differs from plain bf16 generate only after a near-tie. The logits of a 1-token and a
# multi-token bf16 forward differ by rounding, at most δ per entry (measured: 0.6 % of max|logit| here, 1.2 % on
# SmolLM2-135M), so a first divergence needs plain generate's top-2 gap below 2δ: checked against 3 % of max|logit|.
BF16_RELATIVE_GAP = 0.03


def test_bfloat16_keeps_the_documented_guarantee(prompts):
    target = tiny_llama(CYCLE_VOCAB, 32, 2, seed=3, initializer_range=0.1).to(torch.bfloat16)
    config = DSparkConfig.for_target(target, target_layer_ids=[0], num_hidden_layers=1, sequential_rank=8,
                                     mask_token_id=0)
    torch.manual_seed(9)
    drafter = DSparkDrafter(config).eval()  # untrained: verification forwards of several tokens all the same
    diverged = 0
    for prompt in prompts:
        ref = target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
        result = dspark(target, prompt, drafter, return_dict_in_generate=True, output_scores=True)
        out, n = result.sequences, prompt.shape[1]
        assert torch.equal(torch.stack([s[0].argmax() for s in result.scores]), out[0, n:])
        if not torch.equal(out, ref):
            diverged += 1
            i = int((out[0] != ref[0]).nonzero()[0])
            with torch.no_grad():
                logits = target(ref[:, :i]).logits[0, -1].float()
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) < BF16_RELATIVE_GAP * float(logits.abs().max()), f"diverged at {i}: {top2}"
    assert drafter.dtype == torch.bfloat16
    print(f"bf16: {diverged} of {len(prompts)} outputs differ from plain generate (all after near-ties)")


# ---------------------------------------------------------------------------- 2. inference contexts
@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad])
def test_first_and_later_calls_under_inference_contexts(stop_setup, context):
    """The failing case of the issue: a draft vocabulary (lm_head rows gathered at bind) on prepacked CPU kernels."""
    target, prompt, _ = stop_setup
    packed = prepack_linears(copy.deepcopy(target))
    drafter = sampling_drafter(packed, draft_vocab=6)
    prompts = [prompt, prompt[:, 1:], torch.tensor([[3, 5, 1, 7]])]
    references = [packed.generate(p, max_new_tokens=MAX_NEW, do_sample=False) for p in prompts]
    with context():
        for p, ref in zip(prompts, references):  # the first call binds inside the context
            assert_greedy_identical(packed, dspark(packed, p, drafter), ref, context.__name__)
    for p, ref in zip(prompts, references):  # and the drafter still works outside it
        assert_greedy_identical(packed, dspark(packed, p, drafter), ref, "after the context")


def test_text_generation_pipeline(target, prompts):
    tok = char_tokenizer()
    pipe = pipeline("text-generation", model=target, tokenizer=tok)
    drafter = ready_cycle_drafter(target, "markov")
    for prompt in prompts[:3]:
        text = tok.decode(prompt[0])
        plain = pipe(text, max_new_tokens=MAX_NEW, do_sample=False)[0]["generated_text"]
        ours = pipe(text, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter,
                    dspark_verification="fixed")[0]["generated_text"]
        assert ours == plain and len(plain) == len(text) + MAX_NEW
        assert drafter.last_stats.new_tokens == MAX_NEW


# ------------------------------------------------------------------------------------------ routing
def test_routing_binds_transformers_arguments_by_name(target, drafter, prompts):
    """transformers may pass _get_candidate_generator's arguments in any order or by keyword."""
    from transformers import GenerationConfig, LogitsProcessorList

    from dspark_hf import DSparkCandidateGenerator
    from dspark_hf.runtime.capture import LayerCapture

    config = GenerationConfig(max_length=20, do_sample=False, dspark_verification="fixed")
    kwargs = dict(generation_config=config, input_ids=prompts[1], inputs_tensor=prompts[1],
                  logits_processor=LogitsProcessorList(), model_kwargs={}, assistant_model=drafter)
    with LayerCapture(target, drafter.config.target_layer_ids):  # what generate's assisted loop runs inside
        by_name = target._get_candidate_generator(**dict(reversed(list(kwargs.items()))))
        positional = target._get_candidate_generator(*list(kwargs.values())[:5], assistant_model=drafter)
    assert type(by_name) is type(positional) is DSparkCandidateGenerator and by_name.block_size == 4


def test_missing_transformers_signature_names_the_supported_range(monkeypatch):
    from transformers.generation.utils import GenerationMixin

    from dspark_hf.decoding import routing as generation

    monkeypatch.setattr(GenerationMixin, "_assisted_decoding", lambda self, input_ids, **model_kwargs: None)
    with pytest.raises(ImportError, match=r"_assisted_decoding.*stopping_criteria.*transformers>=5\.24,<5\.26"):
        generation._stock_signatures()


def test_transformers_outside_the_supported_range_is_refused_naming_it(monkeypatch):
    """The routing replaces private methods of transformers' assisted loop, which changes between minor releases
    (5.25 reads ``num_drafting_tokens`` from the candidate generator): a version outside the tested window fails at
    import with the range to install, not in the first DSpark call."""
    import transformers

    from dspark_hf.decoding import routing as generation

    for version in ("5.26.0", "5.23.1", "6.0.0"):
        monkeypatch.setattr(transformers, "__version__", version)
        with pytest.raises(ImportError, match=rf"this is {version}: install 'transformers>=5\.24,<5\.26'"):
            generation._stock_signatures()
    for version in ("5.24.0", "5.25.0"):
        monkeypatch.setattr(transformers, "__version__", version)
        assert set(generation._stock_signatures()) == set(generation._REQUIRED_PARAMETERS)


def test_supported_range_is_the_declared_dependency():
    from pathlib import Path

    from dspark_hf.decoding.routing import SUPPORTED_TRANSFORMERS

    pyproject = (Path(dspark_hf.__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert f'"transformers{SUPPORTED_TRANSFORMERS}"' in pyproject


# ------------------------------------------------- 3. stateful processors, pre-filled caches, half precision (issue 25)
@pytest.mark.parametrize(("option", "reason"), [
    (lambda target: {"guidance_scale": 1.5}, r"guidance_scale.*own KV cache.*one call per emitted token"),
    (lambda target: {"logits_processor": LogitsProcessorList([UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, target)])},
     r"guidance_scale"),
    (lambda target: {"watermarking_config": SynthIDTextWatermarkingConfig(keys=[11, 22, 33], ngram_len=2)},
     r"SynthIDTextWatermarkingConfig.*across calls"),
], ids=["guidance_scale", "user_cfg_processor", "synthid"])
def test_stateful_processors_raise_before_compute(target, drafter, prompts, forward_calls, option, reason):
    """The issue's case: guidance_scale=1.5 (greedy) gave another text than plain generate, silently."""
    with pytest.raises(ValueError, match=reason):
        dspark(target, prompts[1], drafter, **option(target))
    assert not forward_calls, "the target ran before the error"


def test_stateless_watermark_stays_identical(target, drafter, prompts, references):
    """The green-list watermark reseeds from the ids on every call: a function of (ids, scores), so it is allowed."""
    watermark = WatermarkingConfig(bias=2.5, context_width=1)
    for prompt in prompts[:4]:
        plain = target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, watermarking_config=watermark)
        assert_greedy_identical(target, dspark(target, prompt, drafter, watermarking_config=watermark), plain, "watermark")


# A chat prompt of 45 tokens whose first 40 (or 10) are in a DynamicCache: plain generate feeds the uncached tokens at
# their positions; DSpark used to feed all 45 on top of the cache (another first token). A context-sensitive random
# target and an untrained drafter: the identity must come from the verification alone.
@pytest.fixture(scope="module")
def chat_setup():
    target = tiny_llama(CYCLE_VOCAB, 32, 2, seed=3, initializer_range=0.1)
    torch.manual_seed(9)
    drafter = DSparkDrafter(DSparkConfig.for_target(target, target_layer_ids=[0], num_hidden_layers=1,
                                                    sequential_rank=8, mask_token_id=0)).eval()
    prompt = torch.randint(1, CYCLE_VOCAB, (1, 45), generator=torch.Generator().manual_seed(7))
    return target, drafter, prompt


def prefilled(target, ids) -> DynamicCache:
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids, cache=cache)
    return cache


@pytest.mark.parametrize("cached", [40, 10])
@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_prefilled_cache_gives_plain_generate_output(chat_setup, cached, name):
    target, drafter, prompt = chat_setup
    uncached = target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    plain = target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, cache=prefilled(target, prompt[:, :cached]))
    assert torch.equal(plain, uncached)  # the premise: plain generate over the cache equals the no-cache output
    cache = prefilled(target, prompt[:, :cached])
    ours = dspark(target, prompt, drafter, **{name: cache})
    assert torch.equal(ours, plain)
    assert cache.get_seq_length() == ours.shape[1] - 1  # the cache holds the sequence, as plain generate leaves it


def test_chat_continued_with_the_returned_cache(chat_setup):
    """The common case: the second turn of a chat passes the cache the first ``generate`` returned."""
    target, drafter, prompt = chat_setup
    first = dspark(target, prompt[:, :30], drafter, return_dict_in_generate=True)
    ids = torch.cat([first.sequences, prompt[:, 30:]], dim=-1)
    plain = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(dspark(target, ids, drafter, cache=first.cache), plain)


def test_cache_with_only_the_new_ids_is_refused(chat_setup):
    target, drafter, prompt = chat_setup
    cache = prefilled(target, prompt[:, :40])
    calls = []
    handle = target.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="ids of the whole sequence"):
            dspark(target, prompt[:, 40:], drafter, cache=cache, attention_mask=torch.ones_like(prompt))
    finally:
        handle.remove()
    assert not calls and cache.get_seq_length() == 40


# bf16 / fp16, do_sample=True, top_k=0: the q each draft is sampled from must be the q speculative sampling divides by.
# Issue 25: the drafter sampled from a float32 softmax and returned bf16 logits, whose softmax differs by ~1e-3
# (relative, at the drafted token); the same tensor gives float32 round-off (a batched vs a single-row softmax).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sampling_divides_by_the_sampled_q(chat_setup, monkeypatch, dtype):
    target, drafter, prompt = chat_setup
    half, half_drafter = copy.deepcopy(target).to(dtype), copy.deepcopy(drafter).to(dtype)
    sampled, used, drafted = [], [], []
    multinomial, speculative_sampling = torch.multinomial, generation_utils._speculative_sampling

    def recording_multinomial(probs, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == drafting.__name__:  # the drafter's draws, [R, V]
            sampled.extend(probs.reshape(-1, probs.shape[-1]).clone())
        return multinomial(probs, *args, **kwargs)

    def recording_speculative_sampling(candidate_input_ids, candidate_logits, candidate_length, *args, **kwargs):
        used.extend(candidate_logits.softmax(dim=-1)[0])  # as transformers computes q
        drafted.extend(candidate_input_ids[0, -candidate_length:])
        return speculative_sampling(candidate_input_ids, candidate_logits, candidate_length, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", recording_multinomial)
    monkeypatch.setattr(generation_utils, "_speculative_sampling", recording_speculative_sampling)
    torch.manual_seed(0)
    half.generate(prompt[:, :8], max_new_tokens=MAX_NEW, do_sample=True, top_k=0, assistant_model=half_drafter,
                  dspark_verification="fixed", dspark_block_size=4)
    assert half_drafter.dtype == dtype and len(used) == len(sampled) >= 8  # fixed mode: every draft is verified
    q_used, q_sampled, tokens = torch.stack(used).double(), torch.stack(sampled).double(), torch.stack(drafted)
    rows = torch.arange(len(tokens))
    assert (q_used[rows, tokens] / q_sampled[rows, tokens] - 1).abs().max() < 1e-6
    assert (q_used.sum(-1) - 1).abs().max() < 1e-6
