"""Grouped-query SDPA (dspark_hf.runtime.attention): the attention maths of a hand-written reference under every
mask kind, transformers' stock ``sdpa`` logits on GQA and non-GQA models with left padding, and DSpark's greedy
identity on a target switched to it."""

import copy

import pytest
import torch
from conftest import cycle_drafter, cycle_target, tiny_llama, tiny_sps_curve
from transformers import DynamicCache

from dspark_hf import SequentialTemperatureScaling
from dspark_hf.runtime import attention, tuning
from dspark_hf.runtime.attention import (
    FOLD_MAX_QUERIES,
    SDPA_GQA,
    fold_mask,
    gqa_sdpa_mask,
    sdpa_gqa_attention_forward,
    use_gqa_attention,
    uses_gqa_attention,
)
from dspark_hf.runtime.kv_cache import GrowingCache
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


def _left_padded_block(heads: int, kv_heads: int, q_len: int, k_len: int):
    """Random ``q [2, heads, q_len, 8]``, ``k, v [2, kv_heads, k_len, 8]`` and the boolean causal mask ``[2, 1, q_len,
    k_len]`` of a block at the end of the cache, the first sequence's 5 leading positions padding."""
    g = torch.Generator().manual_seed(heads + q_len)
    q = torch.randn(2, heads, q_len, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, k_len, 8, generator=g) for _ in range(2))
    mask = (torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len))[None, None]
    mask = mask.expand(2, 1, q_len, k_len).clone()
    mask[0, :, :, :5] = False  # left padding
    return q, k, v, mask


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("q_len", [1, 3, 8])
@pytest.mark.parametrize("fold", [True, False])  # False: the threads' split made the layer run unfolded
def test_mask_folded_once_per_forward_matches_reference(heads, kv_heads, q_len, fold, monkeypatch):
    """The mask gqa_sdpa_mask hands every layer (additive, folded for the query heads of a group) gives the same
    attention as the boolean mask it comes from, whether the layer folds its queries or not; a fully masked query
    row stays finite."""
    monkeypatch.setattr(attention, "folds", lambda *args: fold)
    q, k, v, mask = _left_padded_block(heads, kv_heads, q_len, 13 + q_len)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    folded = fold_mask(additive, heads // kv_heads)
    assert folded.shape == (2, 1, heads // kv_heads * q_len, 13 + q_len)
    out, _ = sdpa_gqa_attention_forward(_Module(), q, k, v, folded)
    torch.testing.assert_close(out, reference_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)
    mask[1, :, 0] = False  # a query that sees nothing (a padded position): finite, not NaN
    out, _ = sdpa_gqa_attention_forward(_Module(), q, k, v, fold_mask(
        torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min), heads // kv_heads))
    assert torch.isfinite(out).all()


class _CountingSDPA:
    """Stands in for ``torch.nn.functional`` in attention.py: the real SDPA, counting its calls."""

    def __init__(self):
        self.calls = 0

    def scaled_dot_product_attention(self, *args, **kwargs):
        self.calls += 1
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("q_len", [1, 3, 8])
def test_head_by_head_blocks_match_reference(heads, kv_heads, q_len, monkeypatch):
    """A folded block over at least PREFETCH_MIN_KEYS positions runs one SDPA per K/V head where splits_heads says
    so: the same attention as the reference under a left-padded causal mask, boolean or folded additive, and
    bit-identical to the one-call SDPA; a 1-token step keeps one call."""
    monkeypatch.setattr(attention, "folds", lambda *args: True)
    monkeypatch.setattr(attention, "PREFETCH_MIN_KEYS", 16)
    spy = _CountingSDPA()
    monkeypatch.setattr(attention, "F", spy)
    q, k, v, mask = _left_padded_block(heads, kv_heads, q_len, 16 + q_len)
    folded = fold_mask(torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min), heads // kv_heads)
    expected = reference_attention(q, k, v, mask)
    for given in (mask, folded):
        outs = {}
        for split in (True, False):
            monkeypatch.setattr(attention, "splits_heads", lambda *args, split=split: split)
            spy.calls = 0
            outs[split], _ = sdpa_gqa_attention_forward(_Module(), q, k, v, given)
            assert spy.calls == (kv_heads if q_len > 1 and split else 1)
        torch.testing.assert_close(outs[True], expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("guard", ["keys", "measured", "unfolded"])
def test_head_by_head_only_for_long_folded_blocks_where_faster(guard, monkeypatch):
    """One SDPA call (not one per K/V head) below PREFETCH_MIN_KEYS positions, where splits_heads measured the one
    call faster (e.g. 2 threads, where a single head leaves a thread idle) and where the layer does not fold; the
    choice is asked for the block's unfolded query and its K/V heads."""
    asked = []
    monkeypatch.setattr(attention, "folds", lambda *args: guard != "unfolded")
    monkeypatch.setattr(attention, "splits_heads", lambda query, kv_heads: asked.append(
        (tuple(query.shape), kv_heads)) or guard != "measured")
    monkeypatch.setattr(attention, "PREFETCH_MIN_KEYS", 24 + (guard == "keys"))
    spy = _CountingSDPA()
    monkeypatch.setattr(attention, "F", spy)
    q, k, v = torch.randn(1, 6, 8, 8), torch.randn(1, 2, 24, 8), torch.randn(1, 2, 24, 8)
    mask = (torch.arange(24)[None, :] <= torch.arange(8)[:, None] + 16)[None, None]
    out, _ = sdpa_gqa_attention_forward(_Module(), q, k, v, mask)
    torch.testing.assert_close(out, reference_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)
    assert spy.calls == 1
    assert asked == ([((1, 6, 8, 8), 2)] if guard == "measured" else [])


class _FakeKernels:
    """Stands in for ``torch.nn.functional`` in attention.py and ``time`` in tuning.py: each SDPA call advances a
    fake clock by ``ms[folded]`` and records the shapes it was given."""

    def __init__(self, unfolded_ms: float, folded_ms: float):
        self.ms, self.now, self.calls = {False: unfolded_ms, True: folded_ms}, 0.0, []

    def perf_counter(self):
        return self.now

    def scaled_dot_product_attention(self, query, key, value, attn_mask=None, enable_gqa=False):
        folded = query.shape[1] == key.shape[1]
        self.calls.append((folded, tuple(query.shape), None if attn_mask is None else tuple(attn_mask.shape)))
        self.now += 1e-3 * self.ms[folded]
        return query


@pytest.mark.parametrize("unfolded_ms,folded_ms,expected", [(3.0, 2.0, True), (2.0, 3.0, False), (2.0, 2.0, True)])
def test_folding_is_chosen_by_what_it_costs_on_this_cpu(unfolded_ms, folded_ms, expected, monkeypatch):
    """folds times both kernels (SmolLM2's shapes: 9 query heads, 3 K/V heads) once per shape, thread count and
    block kind, interleaved, and keeps the faster; a tie folds. The folded kernel gets the query heads of a group as
    rows and the mask folded with them; a 1-token step is timed without a mask, as decoding runs it."""
    fake = _FakeKernels(unfolded_ms, folded_ms)
    monkeypatch.setattr(attention, "F", fake)
    monkeypatch.setattr(tuning, "time", fake)
    monkeypatch.setattr(tuning, "_CHOICES", {})
    step, block = torch.zeros(1, 9, 1, 64), torch.zeros(1, 9, 5, 64)
    assert attention.folds(step, 3) is expected and attention.folds(block, 3) is expected
    per_choice = 2 * (tuning.TUNE_REPEATS + 1)
    assert len(fake.calls) == 2 * per_choice
    ctx, b = attention.TUNE_CONTEXT, attention.TUNE_BLOCK
    assert fake.calls[:2] == [(True, (1, 3, 3, 64), None), (False, (1, 9, 1, 64), None)]
    assert fake.calls[per_choice:per_choice + 2] == [(True, (1, 3, 3 * b, 64), (1, 1, 3 * b, ctx)),
                                                     (False, (1, 9, b, 64), (1, 1, b, ctx))]
    assert attention.folds(torch.zeros(1, 9, 8, 64), 3) is expected and len(fake.calls) == 2 * per_choice  # kept
    torch.set_num_threads(2)  # the module's one_thread fixture restores its own value at the end
    attention.folds(step, 3)
    assert len(fake.calls) == 3 * per_choice  # another thread count is measured anew
    torch.set_num_threads(1)


class _FakeHeadKernels:
    """Stands in for ``torch.nn.functional`` in attention.py and ``time`` in tuning.py: an SDPA call over all
    ``kv_heads`` K/V heads advances a fake clock by ``one_call_ms``, one over a single head by ``head_by_head_ms /
    kv_heads``; records the shapes of each call and the storage its keys come from."""

    def __init__(self, one_call_ms: float, head_by_head_ms: float, kv_heads: int):
        self.one_call_ms, self.head_ms, self.kv_heads, self.now, self.calls = one_call_ms, head_by_head_ms, kv_heads, 0.0, []

    def perf_counter(self):
        return self.now

    def scaled_dot_product_attention(self, query, key, value, attn_mask=None, dropout_p=0.0, scale=None):
        self.calls.append((tuple(query.shape), tuple(key.shape), tuple(attn_mask.shape),
                           key.untyped_storage().data_ptr()))
        self.now += 1e-3 * (self.one_call_ms if key.shape[1] == self.kv_heads else self.head_ms / self.kv_heads)
        return query


@pytest.mark.parametrize("one_call_ms,head_by_head_ms,expected", [(3.0, 2.0, True), (2.0, 3.0, False),
                                                                  (2.0, 2.0, False)])
def test_head_split_is_chosen_by_what_it_costs_on_this_cpu(one_call_ms, head_by_head_ms, expected, monkeypatch):
    """splits_heads times one layer's folded TUNE_BLOCK-token block over TUNE_CONTEXT positions (SmolLM2's shapes: 9
    query heads, 3 K/V heads) as one SDPA call and head by head, interleaved, once per shape and thread count, and
    keeps the faster; a tie keeps one call. Each call reads the next layer's K/V of a ring of TUNE_RING_BYTES (4
    layers of 3 MiB here), so no call finds them in cache from the one before; never on another device."""
    fake = _FakeHeadKernels(one_call_ms, head_by_head_ms, 3)
    monkeypatch.setattr(attention, "F", fake)
    monkeypatch.setattr(tuning, "time", fake)
    monkeypatch.setattr(tuning, "_CHOICES", {})
    assert attention.splits_heads(torch.zeros(1, 9, 5, 64), 3) is expected
    rounds = tuning.TUNE_REPEATS + 1
    assert len(fake.calls) == 4 * rounds  # one call, then 3 heads, per round
    ctx, rows = attention.TUNE_CONTEXT, 3 * attention.TUNE_BLOCK
    assert [c[:3] for c in fake.calls[:4]] == [((1, 3, rows, 64), (1, 3, ctx, 64), (1, 1, rows, ctx))] + [
        ((1, 1, rows, 64), (1, 1, ctx, 64), (1, 1, rows, ctx))] * 3
    assert all(len({c[3] for c in fake.calls[i : i + 3]}) == 1 for i in range(1, 4 * rounds, 4))  # one layer's heads
    keys = [fake.calls[4 * (i // 2) + i % 2][3] for i in range(2 * rounds)]  # each kernel call's layer, as they ran
    assert len(set(keys)) == attention.TUNE_RING_BYTES // (2 * 3 * ctx * 64 * 4) == 4
    assert keys == [keys[i % 4] for i in range(2 * rounds)]  # each layer's K/V read once every 4 calls
    assert attention.splits_heads(torch.zeros(1, 9, 8, 64), 3) is expected and len(fake.calls) == 4 * rounds  # kept
    torch.set_num_threads(2)  # the module's one_thread fixture restores its own value at the end
    attention.splits_heads(torch.zeros(1, 9, 8, 64), 3)
    assert len(fake.calls) == 8 * rounds  # another thread count is measured anew
    torch.set_num_threads(1)
    assert not attention.splits_heads(torch.zeros(1, 9, 8, 64, device="meta"), 3)


def test_gqa_sdpa_mask_folds_short_blocks_of_grouped_models_only():
    """A block of up to FOLD_MAX_QUERIES queries of a GQA model: the stock mask made additive and repeated once per
    query head of a group; prefill-sized blocks and models without grouped heads: the stock mask itself."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    def masks(config, q_length, kv_length=90):
        padding = torch.ones(2, kv_length, dtype=torch.bool)
        padding[0, :3] = False
        args = dict(batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=kv_length - q_length,
                    kv_offset=0, mask_function=causal_mask_function, attention_mask=padding,
                    allow_is_causal_skip=True, dtype=torch.float32, config=config)
        return sdpa_mask(**args), gqa_sdpa_mask(**args)

    gqa = tiny_llama(50, 16, 1, num_key_value_heads=1).config  # 4 query heads per K/V head
    stock, ours = masks(gqa, 5)
    assert stock.dtype == torch.bool and ours.shape == (2, 1, 4 * 5, 90) and ours.dtype == torch.float32
    expected = torch.zeros(stock.shape).masked_fill(~stock, torch.finfo(torch.float32).min)
    for j in range(4):
        assert torch.equal(ours[:, :, 5 * j : 5 * (j + 1)], expected)
    stock, ours = masks(gqa, FOLD_MAX_QUERIES + 1)
    assert ours.dtype == torch.bool and torch.equal(ours, stock)
    stock, ours = masks(tiny_llama(50, 16, 1, num_key_value_heads=4).config, 5)
    assert torch.equal(ours, stock)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])  # 4 and 2 query heads per K/V head, and plain multi-head
@pytest.mark.parametrize("head_by_head", [False, True])  # True: every block runs one SDPA per K/V head
def test_logits_match_stock_through_crops_and_regrowth(kv_heads, head_by_head, monkeypatch):
    """This package's kernels (folded GQA attention and masks, GrowingCache) against stock sdpa + DynamicCache on a
    left-padded batch: a prefill longer than FOLD_MAX_QUERIES, then blocks of 3, 8, 1 and 9 tokens with crops
    between them (rejected drafts), as verification runs them; with blocks over any cache length run head by head
    (PREFETCH_MIN_KEYS lowered to 1, splits_heads forced) too."""
    runs = []
    if head_by_head:
        monkeypatch.setattr(attention, "PREFETCH_MIN_KEYS", 1)
        monkeypatch.setattr(attention, "folds", lambda *args: True)  # not the timing's choices: it must run here
        monkeypatch.setattr(attention, "splits_heads", lambda *args: True)
        real = attention._sdpa_head_by_head
        monkeypatch.setattr(attention, "_sdpa_head_by_head", lambda *args: runs.append(1) or real(*args))
    stock = tiny_llama(97, 32, 2, num_key_value_heads=kv_heads)
    ours = use_cpu_kernels(copy.deepcopy(stock), prepack=False)
    g = torch.Generator().manual_seed(kv_heads)
    prompt = FOLD_MAX_QUERIES + 6
    ids = torch.randint(1, 97, (2, prompt + 40), generator=g)
    padding = torch.ones(2, prompt + 40, dtype=torch.long)
    padding[1, :7] = 0
    logits = {}
    with torch.no_grad():
        for name, model, cache in (("stock", stock, DynamicCache(config=stock.config)),
                                   ("ours", ours, GrowingCache(config=ours.config))):
            out, pos = [], 0
            for n, crop in ((prompt, 0), (3, 2), (8, 5), (1, 0), (9, 0)):
                out.append(model(input_ids=ids[:, pos : pos + n], attention_mask=padding[:, : pos + n],
                                 cache=cache).logits)
                pos += n - crop
                if crop:
                    cache.crop(-crop)
            assert cache.get_seq_length() == pos == prompt + 14
            logits[name] = torch.cat(out, 1)
    keep = torch.cat([padding[:, :prompt], torch.ones(2, 21, dtype=torch.long)], 1).bool()
    torch.testing.assert_close(logits["ours"][keep], logits["stock"][keep], rtol=1e-5, atol=1e-5)
    assert len(runs) == (3 * 2 if head_by_head and kv_heads < 4 else 0)  # blocks of 3, 8, 9 tokens × 2 layers


def test_only_sdpa_models_are_switched():
    eager = tiny_llama(50, 16, 1, attn_implementation="eager")
    assert not use_gqa_attention(eager) and eager.config._attn_implementation == "eager"
    model = tiny_llama(50, 16, 1)
    assert not uses_gqa_attention(model) and use_gqa_attention(model) and model.config._attn_implementation == SDPA_GQA
    assert use_gqa_attention(model)  # idempotent


@pytest.mark.parametrize("fold,split", [(True, True), (True, False), (False, True)])
def test_cpu_kernels_label_and_opt_out(fold, split, monkeypatch):
    """The label says +head-by-head where a folded block of the model's shapes runs head by head (both choices
    asked for a 1-sequence TUNE_BLOCK-token block), not for a model without grouped K/V heads."""
    asked = []
    monkeypatch.setattr(attention, "folds", lambda query, kv_heads: asked.append((tuple(query.shape), kv_heads)) or fold)
    monkeypatch.setattr(attention, "splits_heads", lambda query, kv_heads: asked.append(
        (tuple(query.shape), kv_heads)) or split)
    model = use_cpu_kernels(tiny_llama(50, 16, 1), prepack=False)  # 4 query heads, 2 K/V heads of 8
    head_by_head = "+head-by-head" * (fold and split)
    assert kernels_label(model) == f"stock+sdpa-gqa{head_by_head}+growing-cache+tuned"
    assert asked == [((1, 4, attention.TUNE_BLOCK, 8), 2)] * (1 + fold)
    assert kernels_label(use_cpu_kernels(tiny_llama(50, 16, 1, num_key_value_heads=4), prepack=False)) == (
        "stock+sdpa-gqa+growing-cache+tuned")
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
