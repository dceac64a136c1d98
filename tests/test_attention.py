"""Grouped-query SDPA (dspark_hf.runtime.attention): the attention maths of a hand-written reference under every
mask kind, transformers' stock ``sdpa`` logits on GQA and non-GQA models with left padding, and DSpark's greedy
identity on a target switched to it."""

import copy

import pytest
import torch
from conftest import cycle_drafter, cycle_target, tiny_llama, tiny_sps_curve
from transformers import DynamicCache

from dspark_hf import SequentialTemperatureScaling
from dspark_hf.runtime.attention import SDPA_GQA, sdpa_gqa_attention_forward, use_gqa_attention, uses_gqa_attention
from dspark_hf.runtime.targets import kernels_label, load_target, use_cpu_kernels

pytestmark = pytest.mark.usefixtures("one_thread")


class _Module:
    is_causal = True


def reference_attention(q, k, v, mask):
    """softmax(q kᵀ / √D + mask) v with every K/V head copied for its query heads: ``[B, q, H, D]``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "left_padded", "additive"])
@pytest.mark.parametrize("q_len", [1, 3, 8])
def test_matches_reference_attention(heads, kv_heads, mask_kind, q_len):
    g = torch.Generator().manual_seed(q_len)
    batch, ctx, dim = 2, 11, 8
    k_len = q_len if mask_kind == "none" and q_len > 1 else ctx + q_len  # no mask and q > 1: causal prefill
    q = torch.randn(batch, heads, q_len, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, k_len, dim, generator=g) for _ in range(2))
    causal = torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len)  # (q, k)
    mask = None if mask_kind == "none" else causal[None, None].expand(batch, 1, q_len, k_len).clone()
    if mask_kind == "left_padded":
        mask[0, :, :, :4] = False  # the first sequence's 4 leading positions are padding
    if mask_kind == "additive":
        mask = torch.zeros(batch, 1, q_len, k_len).masked_fill(~mask, float("-inf"))
    expected = reference_attention(q, k, v, causal[None, None] if mask_kind == "none" else mask)
    out, weights = sdpa_gqa_attention_forward(_Module(), q, k, v, mask)
    assert weights is None and out.shape == (batch, q_len, heads, dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [2, 4])  # GQA and plain multi-head
def test_logits_match_stock_sdpa_with_left_padding(kv_heads):
    stock = tiny_llama(97, 32, 2, num_key_value_heads=kv_heads)
    ours = copy.deepcopy(stock)
    assert stock.config._attn_implementation == "sdpa" and use_gqa_attention(ours)
    g = torch.Generator().manual_seed(1)
    ids, more = torch.randint(1, 97, (3, 9), generator=g), torch.randint(1, 97, (3, 4), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :5], mask[1, :2] = 0, 0  # left padding
    full_mask = torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], 1)
    logits = {}
    with torch.no_grad():
        for name, model in (("stock", stock), ("ours", ours)):
            cache = DynamicCache(config=model.config)
            prefill = model(input_ids=ids, attention_mask=mask, cache=cache).logits  # (3, 9, V)
            block = model(input_ids=more, attention_mask=full_mask, cache=cache).logits  # 4 tokens with a mask
            logits[name] = torch.cat([prefill, block], 1)
    keep = full_mask.bool()  # padded positions' outputs are meaningless in both
    torch.testing.assert_close(logits["ours"][keep], logits["stock"][keep], rtol=1e-5, atol=1e-5)
    assert (logits["ours"][keep] - logits["stock"][keep]).abs().max() < 1e-4


def test_only_sdpa_models_are_switched():
    eager = tiny_llama(50, 16, 1, attn_implementation="eager")
    assert not use_gqa_attention(eager) and eager.config._attn_implementation == "eager"
    model = tiny_llama(50, 16, 1)
    assert not uses_gqa_attention(model) and use_gqa_attention(model) and model.config._attn_implementation == SDPA_GQA
    assert use_gqa_attention(model)  # idempotent


def test_cpu_kernels_label_and_opt_out():
    model = use_cpu_kernels(tiny_llama(50, 16, 1), prepack=False)
    assert kernels_label(model) == "stock+sdpa-gqa+growing-cache"
    assert kernels_label(tiny_llama(50, 16, 1)) == "stock"
    with pytest.raises(ValueError, match="pass one"):
        load_target("unused", prepack=True, stock_kernels=True)  # refused before anything loads


def test_load_target_sets_the_command_lines_thread_count(monkeypatch, tmp_path):
    """Issue 26: Python (torch's one thread per core) and the CLI (--threads 1) keyed two SPS curves, so the README's
    Python snippet profiled again. load_target now sets the CLI's default; threads=None keeps torch's setting."""
    from dspark_hf.cli.common import DEFAULT_THREADS
    from dspark_hf.runtime import targets

    monkeypatch.setattr(targets.AutoTokenizer, "from_pretrained", lambda path: "tokenizer")
    monkeypatch.setattr(targets.AutoModelForCausalLM, "from_pretrained", lambda path, dtype: tiny_llama(50, 16, 1))
    torch.set_num_threads(2)
    load_target(str(tmp_path))
    assert torch.get_num_threads() == 1 == DEFAULT_THREADS
    torch.set_num_threads(2)
    load_target(str(tmp_path), threads=None)
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        load_target(str(tmp_path), threads=0)
    torch.set_num_threads(1)  # the module's one_thread fixture restores its own value at the end


@pytest.mark.parametrize("mode", ["fixed", "async"])  # async: the default (with prompt lookup)
def test_dspark_greedy_identical_on_cpu_kernels(mode):
    target = cycle_target(num_hidden_layers=2, alpha=0.026)
    reference_target = copy.deepcopy(target)
    use_cpu_kernels(target, prepack=False)
    drafter = cycle_drafter(target, "markov")
    drafter.set_sps_curve(tiny_sps_curve())
    drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * 4)
    g = torch.Generator().manual_seed(7)
    for n in (1, 5, 12):
        prompt = torch.randint(1, 64, (1, n), generator=g)
        plain = reference_target.generate(prompt, max_new_tokens=16, do_sample=False)
        out = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                              dspark_verification=mode, dspark_block_size=4, dspark_lookup=mode == "async")
        assert torch.equal(out, plain)
        assert target.generate(prompt, max_new_tokens=16, do_sample=False).equal(plain)
