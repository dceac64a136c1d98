"""oneDNN prepacked linears: same values as F.linear, never stale, autograd intact, and lossless DSpark on them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama, tiny_sps_curve

from dspark_hf import DSparkConfig, DSparkDrafter
from dspark_hf.runtime import kernels
from dspark_hf.runtime.kernels import (
    PACKED_ATTR,
    PackedWeight,
    can_prepack,
    is_prepacked,
    linear_kernels,
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


@pytest.mark.parametrize("stock_faster", [True, False])
def test_a_single_row_runs_the_kernel_the_forward_is_faster_with(stock_faster, monkeypatch):
    """choose_one_row_kernel times the model's 1-token forward with every single row on the prepacked kernel and on
    F.linear (asked once, by model size, dtype), keeps the one tuning.faster says is faster; blocks of more rows
    always run prepacked, and the values are F.linear's either way."""
    recording, asked = _RecordingF(), []

    def choose(key, make_kernels, repeats):
        asked.append(key)
        prepacked, stock = make_kernels()
        with torch.inference_mode():  # as tuning.faster times them (autograd would take the stock path)
            prepacked()
            assert recording.rows == []  # no row went to F.linear
            stock()
        assert recording.rows and set(recording.rows) == {1}  # every linear's single row did
        recording.rows.clear()
        return int(stock_faster)

    monkeypatch.setattr(kernels, "faster", choose)
    monkeypatch.setattr(kernels, "F", recording)
    model = prepack_linears(tiny_llama(32, 16, 1))
    assert kernels.choose_one_row_kernel(model) == ("stock" if stock_faster else "prepacked")
    assert asked == [("forward-1-row", sum(p.numel() for p in model.parameters()), torch.float32)]
    layer = model.model.layers[0].mlp.up_proj
    for rows in (1, 3):
        x = torch.randn(1, rows, layer.in_features)
        with torch.inference_mode():
            out = layer(x)
        torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=0, atol=1e-5)
    assert recording.rows == ([1] if stock_faster else [])
    assert kernels.choose_one_row_kernel(tiny_llama(32, 16, 1)) == "none"


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


def test_sps_cache_tells_kernels_apart():
    stock = tiny_llama(32, 16, 1, name="tiny")
    packed = prepack_linears(tiny_llama(32, 16, 1, name="tiny"))
    assert sps_cache_path(stock) != sps_cache_path(packed)


def test_greedy_dspark_on_prepacked_target_matches_plain_generate():
    target = prepack_linears(tiny_llama(64, 32, 2, seed=3, name="tiny"))
    torch.manual_seed(1)
    drafter = DSparkDrafter(DSparkConfig.for_target(target, num_hidden_layers=1, sequential_head="markov",
                                                    sequential_rank=8, block_size=4, verification="fixed", mask_token_id=0))
    drafter.set_sps_curve(tiny_sps_curve())
    prompt = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    reference = target.generate(prompt, **kwargs)
    out = target.generate(prompt, **kwargs, assistant_model=drafter)
    assert torch.equal(out, reference)
    assert is_prepacked(drafter)  # the drafter follows its target's kernels
    assert drafter.bound.packed is getattr(target.lm_head, PACKED_ATTR)  # all rows: the head's packed copy
