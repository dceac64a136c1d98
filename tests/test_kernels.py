"""oneDNN prepacked linears: same values as F.linear, never stale, autograd intact, and lossless DSpark on them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama, tiny_sps_curve

from dspark_hf import DSparkConfig, DSparkDrafter
from dspark_hf.runtime import kernels
from dspark_hf.runtime.kernels import (
    ONE_ROW_KERNELS,
    PACKED_ATTR,
    PackedWeight,
    can_prepack,
    is_prepacked,
    linear_kernels,
    prepack_like,
    prepack_linears,
)
from dspark_hf.runtime.profiling import sps_cache_path

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(1, rows, 32)
    out = PackedWeight(weight).linear(x, weight, bias)
    assert out.shape == (1, rows, 48)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=0, atol=1e-5)


class _RecordingF:
    """``torch.nn.functional`` for kernels.py, counting ``linear`` calls by input rows."""

    def __init__(self):
        self.rows = []

    def linear(self, x, weight, bias=None):
        self.rows.append(x.numel() // x.shape[-1])
        return F.linear(x, weight, bias)


@pytest.mark.parametrize("chosen", range(len(ONE_ROW_KERNELS)))
def test_a_single_row_runs_the_kernel_the_forward_is_fastest_with(chosen, monkeypatch):
    """choose_one_row_kernel times the model's 1-token forward with every single row on each of ONE_ROW_KERNELS
    (asked once, by model size, dtype), keeps the one tuning.faster says is fastest, and keeps the transposed copies
    only where that kernel is chosen; blocks of more rows always run prepacked, and the values are F.linear's."""
    recording, asked = _RecordingF(), []

    def choose(key, make_kernels, repeats):
        asked.append(key)
        prepacked, stock, transposed = make_kernels()
        with torch.inference_mode():  # as tuning.faster times them (autograd would take the stock path)
            prepacked()
            transposed()
            assert recording.rows == []  # no row went to F.linear
            stock()
        assert recording.rows and set(recording.rows) == {1}  # every linear's single row did
        recording.rows.clear()
        return chosen

    monkeypatch.setattr(kernels, "faster", choose)
    monkeypatch.setattr(kernels, "F", recording)
    model = prepack_linears(tiny_llama(32, 16, 1))
    assert kernels.choose_one_row_kernel(model) == ONE_ROW_KERNELS[chosen]
    assert asked == [("forward-1-row", ONE_ROW_KERNELS, sum(p.numel() for p in model.parameters()), torch.float32)]
    packed = [getattr(m, PACKED_ATTR) for m in model.modules() if hasattr(m, PACKED_ATTR)]
    assert {p.one_row for p in packed} == {ONE_ROW_KERNELS[chosen]}
    assert linear_kernels(model) == ("onednn-prepacked", "onednn-prepacked+stock-row",
                                     "onednn-prepacked+transposed-row")[chosen]  # an SPS cache key apart
    assert all((p.transposed is not None) == (ONE_ROW_KERNELS[chosen] == "transposed") for p in packed)
    layer = model.model.layers[0].mlp.up_proj
    for rows in (1, 3):
        x = torch.randn(1, rows, layer.in_features)
        with torch.inference_mode():
            out = layer(x)
        torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=0, atol=1e-5)
    assert recording.rows == ([1] if ONE_ROW_KERNELS[chosen] == "stock" else [])
    assert kernels.choose_one_row_kernel(tiny_llama(32, 16, 1)) == "none"


def test_transposed_single_row_reads_its_copy_and_follows_the_weight():
    """A single row on "transposed" is x @ W^T + b from the kept [in, out] copy (a different copy, a different
    answer), rebuilt when the weight changes in place; blocks stay on the packed kernel; an unknown kernel is refused."""
    torch.manual_seed(0)
    weight, bias, row, block = torch.randn(16, 8), torch.randn(16), torch.randn(1, 1, 8), torch.randn(1, 3, 8)
    packed = PackedWeight(weight)
    packed.use_one_row("transposed", weight)
    assert packed.transposed.shape == (8, 16) and packed.transposed.is_contiguous()
    torch.testing.assert_close(packed.linear(row, weight, bias), F.linear(row, weight, bias), rtol=0, atol=1e-5)
    weight.mul_(-2.0)  # stale packed and transposed copies
    torch.testing.assert_close(packed.linear(row, weight, bias), F.linear(row, weight, bias), rtol=0, atol=1e-5)
    torch.testing.assert_close(packed.linear(block, weight), F.linear(block, weight), rtol=0, atol=1e-5)
    packed.transposed = torch.zeros(8, 16)
    torch.testing.assert_close(packed.linear(row, weight, bias), bias.expand(1, 1, 16))
    packed.use_one_row("stock", weight)
    assert packed.transposed is None
    with pytest.raises(ValueError, match="one-row kernel must be one of"):
        packed.use_one_row("fast", weight)


def test_weight_updated_in_place_is_repacked():
    torch.manual_seed(0)
    weight, x = torch.randn(16, 8), torch.randn(3, 8)
    packed = PackedWeight(weight)
    weight.mul_(-2.0)  # bumps the tensor version: the packed copy is stale
    torch.testing.assert_close(packed.linear(x, weight), F.linear(x, weight), rtol=0, atol=1e-5)


def test_prepacked_module_keeps_autograd_and_values():
    torch.manual_seed(0)
    stock = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    packed = prepack_linears(copy.deepcopy(stock))
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), stock(x), rtol=0, atol=1e-5)
    packed(x).sum().backward()
    stock(x).sum().backward()
    torch.testing.assert_close(packed[0].weight.grad, stock[0].weight.grad)
    with torch.no_grad():
        packed[0].weight.add_(1.0)
        stock[0].weight.add_(1.0)
        torch.testing.assert_close(packed(x), stock(x), rtol=0, atol=1e-5)


def test_prepack_marks_the_model_and_is_idempotent():
    model = tiny_llama(32, 16, 1)
    assert linear_kernels(model) == "stock"
    assert prepack_linears(prepack_linears(model)) is model
    assert is_prepacked(model) and linear_kernels(model) == "onednn-prepacked"


def test_unsupported_dtype_raises_naming_the_fix():
    half = torch.nn.Linear(4, 4).to(torch.float16)
    assert not can_prepack(half) and can_prepack(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"model.float\(\)"):
        prepack_linears(half)


def test_bfloat16_stays_stock_on_a_cpu_without_onednns_bf16_path(monkeypatch):
    """A new user's trial on an AVX2-only EPYC: load_target(dtype=torch.bfloat16), or a prepacked float32 target
    moved to bf16, crashed in oneDNN's reorder ("bf16 path needs the cpu support avx_ne_convert or avx512bw ...").
    Without that path a bf16 model is not prepacked, prepacking it names the fix, and a float32-prepacked model
    converted to bf16 computes with stock linears."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def refuse_bf16(weight, *args):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert ...")
        return reorder(weight, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse_bf16)
    bf16 = tiny_llama(32, 16, 1).to(torch.bfloat16)
    assert not can_prepack(bf16) and can_prepack(tiny_llama(32, 16, 1))
    with pytest.raises(ValueError, match=r"prepack=False"):
        prepack_linears(bf16)
    packed = prepack_linears(tiny_llama(32, 16, 1)).to(torch.bfloat16)
    ids = torch.tensor([[1, 5, 7, 2]])
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, bf16(ids).logits)  # the same weights (tiny_llama's seed), stock kernels


def test_sps_cache_tells_kernels_apart():
    stock = tiny_llama(32, 16, 1, name="tiny")
    packed = prepack_linears(tiny_llama(32, 16, 1, name="tiny"))
    assert sps_cache_path(stock) != sps_cache_path(packed)


@pytest.mark.parametrize("one_row", ONE_ROW_KERNELS)
def test_greedy_dspark_on_prepacked_target_matches_plain_generate(one_row):
    target = prepack_linears(tiny_llama(64, 32, 2, seed=3, name="tiny"))
    for m in target.modules():  # as choose_one_row_kernel leaves it
        if hasattr(m, PACKED_ATTR):
            getattr(m, PACKED_ATTR).use_one_row(one_row, m.weight)
    torch.manual_seed(1)
    drafter = DSparkDrafter(DSparkConfig.for_target(target, num_hidden_layers=1, sequential_head="markov",
                                                    sequential_rank=8, block_size=4, verification="fixed", mask_token_id=0))
    drafter.set_sps_curve(tiny_sps_curve())
    prompt = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    reference = target.generate(prompt, **kwargs)
    out = target.generate(prompt, **kwargs, assistant_model=drafter)
    assert torch.equal(out, reference)
    drafter_packed = [getattr(m, PACKED_ATTR) for m in drafter.modules() if hasattr(m, PACKED_ATTR)]
    assert len(drafter_packed) == sum(isinstance(m, torch.nn.Linear) for m in drafter.modules())
    assert {p.one_row for p in drafter_packed} == {one_row}  # the drafter follows its target's kernels
    assert drafter.bound.packed is getattr(target.lm_head, PACKED_ATTR)  # all rows: the head's packed copy


def test_prepack_like_leaves_a_stock_reference_alone_and_follows_a_packed_one():
    stock, model = tiny_llama(32, 16, 1, name="tiny"), tiny_llama(32, 16, 1, seed=1, name="tiny")
    assert prepack_like(model, stock) is model and not is_prepacked(model)
    reference = prepack_linears(tiny_llama(32, 16, 1, name="tiny"))
    for m in reference.modules():
        if hasattr(m, PACKED_ATTR):
            getattr(m, PACKED_ATTR).use_one_row("stock", m.weight)
    x = torch.randn(1, 1, 16)
    expected = model.model.layers[0].mlp.down_proj(model.model.layers[0].mlp.up_proj(x))
    prepack_like(model, reference)
    assert linear_kernels(model) == "onednn-prepacked+stock-row"
    torch.testing.assert_close(model.model.layers[0].mlp.down_proj(model.model.layers[0].mlp.up_proj(x)), expected,
                               rtol=0, atol=1e-5)
