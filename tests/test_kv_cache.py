"""The O(new tokens) KV cache: KVBuffer against concatenation, GrowingCache against transformers' DynamicCache
(logits, crop and regrow, generate: plain, prompt lookup, beam search, DSpark), its memory bound, and the
default cache of a model after use_growing_cache."""

import copy

import pytest
import torch
from conftest import cycle_drafter, cycle_target, tiny_llama, tiny_sps_curve
from transformers import DynamicCache

from dspark_hf.modeling.kv_buffer import HEADROOM, KVBuffer
from dspark_hf.modeling.outputs import DraftContext
from dspark_hf.runtime.kv_cache import GrowingCache, GrowingLayer, generation_cache, use_growing_cache
from dspark_hf.runtime.profiling import grow_cache

pytestmark = pytest.mark.usefixtures("one_thread")


def test_kv_buffer_matches_concatenation_and_stays_bounded():
    g = torch.Generator().manual_seed(0)
    buffer, ref_k, ref_v = KVBuffer(), torch.empty(2, 3, 0, 4), torch.empty(2, 3, 0, 5)
    for step in range(60):
        if step % 7 == 6:  # a rejection: drop a few positions
            drop = int(torch.randint(0, 6, (1,), generator=g))
            buffer.truncate(buffer.length - drop)
            ref_k, ref_v = ref_k[:, :, : max(0, ref_k.shape[2] - drop)], ref_v[:, :, : max(0, ref_v.shape[2] - drop)]
        else:
            n = int(torch.randint(1, 40, (1,), generator=g))
            k, v = torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 5, generator=g)
            keys, values = buffer.append(k, v)
            ref_k, ref_v = torch.cat([ref_k, k], 2), torch.cat([ref_v, v], 2)
            assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert buffer.length == ref_k.shape[2] and torch.equal(buffer.keys, ref_k) and torch.equal(buffer.values, ref_v)
        assert buffer.length <= buffer.capacity <= 2 * buffer.length + 2 * HEADROOM  # memory ≤ ~2× live
    buffer.truncate(3)  # a large crop releases the storage
    assert buffer.capacity <= 2 * 3 + 2 * HEADROOM and torch.equal(buffer.keys, ref_k[:, :, :3])


def test_kv_buffer_refuses_another_shape():
    buffer = KVBuffer()
    buffer.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="new cache per batch"):
        buffer.append(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))  # would broadcast silently


def test_draft_context_append_is_concatenation():
    g = torch.Generator().manual_seed(1)
    context, ref = DraftContext(2), [None, None]
    assert context.layers == [None, None]
    for n in (5, 1, 3, 200):
        kv = [(torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)) for _ in range(2)]
        context.append(kv, n)
        ref = [kv_i if r is None else (torch.cat([r[0], kv_i[0]], 2), torch.cat([r[1], kv_i[1]], 2)) for r, kv_i in zip(ref, kv)]
    assert context.length == 209
    for (k, v), (rk, rv) in zip(context.layers, ref):
        assert torch.equal(k, rk) and torch.equal(v, rv)


def _steps(model, cache, ids):
    """Logits of a forward sequence with crops: prefill 6, +3, crop 2, +4, crop 4, +1, +5."""
    out, pos = [], 0
    with torch.no_grad():
        for n, crop in ((6, 0), (3, 2), (4, 4), (1, 0), (5, 0)):
            out.append(model(input_ids=ids[:, pos : pos + n], cache=cache).logits)
            pos += n
            if crop:
                cache.crop(-crop)
                pos -= crop
    return torch.cat(out, 1), cache.get_seq_length()


def test_growing_cache_logits_match_dynamic_cache():
    model = tiny_llama(97, 32, 2)
    ids = torch.randint(1, 97, (2, 20), generator=torch.Generator().manual_seed(2))
    ref, ref_len = _steps(model, DynamicCache(config=model.config), ids)
    cache = GrowingCache(config=model.config)
    assert all(type(layer) is GrowingLayer for layer in cache.layers)
    out, length = _steps(model, cache, ids)
    assert length == ref_len == 13
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(2)


@pytest.mark.parametrize("kind", ["plain", "lookup", "beams", "dspark"])
def test_generate_with_each_cache(kind):
    target = cycle_target(num_hidden_layers=2, alpha=0.026)
    kwargs = {"plain": {}, "lookup": {"prompt_lookup_num_tokens": 3}, "beams": {"num_beams": 3}}.get(kind)
    if kind == "dspark":
        drafter = cycle_drafter(target, "markov")
        drafter.set_sps_curve(tiny_sps_curve())
        kwargs = dict(assistant_model=drafter, dspark_verification="fixed", dspark_block_size=4)
    g = torch.Generator().manual_seed(3)
    for n in (1, 6, 13):
        prompt = torch.randint(1, 64, (1, n), generator=g)
        prompt = torch.cat([prompt, prompt], 1) if kind == "lookup" else prompt  # something for lookup to find
        outs = {}
        for name, cache in (("dynamic", DynamicCache(config=target.config)), ("growing", GrowingCache(config=target.config))):
            out = target.generate(prompt, max_new_tokens=20, do_sample=False, cache=cache, return_dict_in_generate=True,
                                  **kwargs)
            outs[name] = out.sequences
            if kind != "beams":
                assert cache.get_seq_length() == out.sequences.shape[1] - 1  # the last token is never fed back
        assert torch.equal(outs["growing"], outs["dynamic"])


def test_use_growing_cache_is_generates_default():
    model = tiny_llama(97, 32, 2)
    stock = copy.deepcopy(model)
    assert type(generation_cache(model)) is DynamicCache
    use_growing_cache(model)
    assert type(generation_cache(model)) is GrowingCache
    prompt = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert type(out.cache) is GrowingCache
    assert torch.equal(out.sequences, stock.generate(prompt, max_new_tokens=12, do_sample=False))
    own = DynamicCache(config=model.config)  # a cache the caller passes is used as is
    assert model.generate(prompt, max_new_tokens=3, cache=own, return_dict_in_generate=True).cache is own
    assert type(stock.generate(prompt, max_new_tokens=3, return_dict_in_generate=True).cache) is DynamicCache


@pytest.mark.parametrize("cache_class", [DynamicCache, GrowingCache])
def test_grow_cache_repeats_the_prefilled_positions(cache_class):
    model = tiny_llama(97, 32, 2)
    cache = cache_class(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 97, (1, 5)), cache=cache)
    first = cache.layers[0].keys.clone()
    grow_cache(model, cache, 12)
    assert cache.get_seq_length() == 12
    torch.testing.assert_close(cache.layers[0].keys, torch.cat([first, first, first[:, :, :2]], 2))
