"""LayerCapture: the target's context-layer features by hooks on those layers only (issue 28's floor)."""

import threading

import pytest
import torch
from conftest import cycle_target, scheduled_cycle_drafter, tiny_llama

from dspark_hf.runtime.capture import LayerCapture

pytestmark = pytest.mark.usefixtures("one_thread")


def test_features_equal_transformers_hidden_states_the_last_layer_after_the_norm():
    """Each layer's record equals transformers' ``hidden_states[i + 1]`` exactly: an inner layer's output, and for the
    last layer the final norm's; concatenated in ``layer_ids`` order, cut to the first positions when asked."""
    target = tiny_llama(61, 32, 3)
    ids = torch.tensor([[5, 9, 3, 7, 1]])
    raw = []
    handle = target.model.layers[2].register_forward_hook(lambda m, a, out: raw.append(out))
    with torch.no_grad():
        reference = target(ids, output_hidden_states=True).hidden_states
        with LayerCapture(target, [2, 0]) as capture:
            target(ids)
            features = capture.features()
            first = capture.features(3)
    handle.remove()
    assert torch.equal(features, torch.cat([reference[3], reference[1]], -1))
    assert not torch.allclose(raw[0], reference[3], atol=1e-3)  # the last layer's own output is not its feature
    assert torch.equal(first, features[:, :3])


def test_only_the_entering_context_is_recorded_and_the_hooks_go_on_exit():
    """A forward in another thread (another request on the same target) leaves the capture as it was; leaving the
    block removes every hook, and reading outside a capture names the fix."""
    target = tiny_llama(61, 32, 2)
    hooks_before = [len(layer._forward_hooks) for layer in target.model.layers]
    with torch.no_grad(), LayerCapture(target, [0]) as capture:
        with pytest.raises(RuntimeError, match="recorded no forward"):
            capture.features()
        target(torch.tensor([[1, 2]]))
        mine = capture.features()
        other = threading.Thread(target=lambda: target(torch.tensor([[3, 4, 5, 6]])))
        other.start()
        other.join()
        assert torch.equal(capture.features(), mine) and LayerCapture.current(target) is capture
    assert [len(layer._forward_hooks) for layer in target.model.layers] == hooks_before
    with pytest.raises(RuntimeError, match="assistant_model=drafter"):
        LayerCapture.current(target)
    with pytest.raises(ValueError, match="decoder layers"):
        LayerCapture(target, [2])


def test_dspark_generate_leaves_no_hooks_on_the_target_and_matches_plain_generate():
    """A DSpark call reads its features through a LayerCapture, so transformers' own output-capturing hooks are never
    installed on the target (they would run in every later forward) and none of ours stay; greedy output unchanged."""
    target = cycle_target(num_hidden_layers=2, alpha=0.026)
    drafter = scheduled_cycle_drafter(target)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    hooks = sum(len(m._forward_hooks) for m in target.modules())
    out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                          dspark_verification="scheduler")
    assert torch.equal(out, plain)
    assert drafter.last_stats.rounds and sum(len(m._forward_hooks) for m in target.modules()) == hooks
    assert not getattr(target.model, "_output_capturing_hooks_installed", False)
