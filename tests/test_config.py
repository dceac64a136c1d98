"""`DSparkConfig` validates every field where it enters (issue 15, class 3).

Property: over random field values (valid and invalid, drawn by hypothesis), ``DSparkConfig(**fields)``
raises ``ValueError`` naming a bad field exactly when the test's own oracle finds one, and every config it
accepts builds a drafter that binds to a matching tiny target and drafts a block (so no invalid value can
slip through to fail later inside SDPA or a oneDNN primitive).
"""

import pytest
import torch
from conftest import tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_hf import DSparkConfig, DSparkDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

VALID = dict(  # small configs (tiny tensors)
    vocab_size=st.integers(8, 40), hidden_size=st.sampled_from([8, 16]), target_num_layers=st.integers(1, 4),
    target_layer_ids=st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True)),
    num_hidden_layers=st.integers(1, 3), num_attention_heads=st.sampled_from([2, 4, 8]),
    num_key_value_heads=st.sampled_from([1, 2]), head_dim=st.sampled_from([2, 4, 8]),
    intermediate_size=st.integers(1, 24), block_size=st.integers(1, 16),
    sequential_head=st.sampled_from(["none", "markov", "rnn"]), sequential_rank=st.integers(1, 6),
    confidence_head=st.booleans(), draft_vocab_size=st.one_of(st.none(), st.integers(1, 8)),
    verification=st.sampled_from(["scheduler", "async", "fixed", "threshold"]),
    confidence_threshold=st.floats(0, 1), rms_norm_eps=st.floats(1e-8, 1e-2), rope_theta=st.floats(1.0, 1e6),
)
INVALID = dict(  # values out of each field's domain (the issue's cases among them)
    vocab_size=[0, -3, 8.0], hidden_size=[0, -8, True], target_num_layers=[0, -1], target_layer_ids=[[], [0, 0], [-1], [9]],
    num_hidden_layers=[0, -1, 1.5], num_attention_heads=[0, True, 3], num_key_value_heads=[0, 5, 4],
    head_dim=[0, 3, -2], intermediate_size=[0, 16.5], block_size=[0, 17, 2.7, True], sequential_head=["lstm", None],
    sequential_rank=[0, -4, 2.5], confidence_head=[1, "yes"], draft_vocab_size=[0, -1, 41],
    verification=["always", ""], confidence_threshold=[-0.1, 1.5, float("nan")], rms_norm_eps=[0.0, -1e-5],
    rope_theta=[0.0, float("inf"), float("nan")], dspark_version=[0, 3], mask_token_id=[-1, 41, 2.0],
)


@st.composite
def config_fields(draw) -> dict:
    """Valid fields, then up to two of them replaced by out-of-domain values (about a third stay valid)."""
    fields = {name: draw(strategy) for name, strategy in VALID.items()}
    fields["dspark_version"] = draw(st.sampled_from([1, 2]))  # v2 needs a mask token, v1 has none
    fields["mask_token_id"] = draw(st.integers(0, 7)) if fields["dspark_version"] == 2 else None
    for name in draw(st.sets(st.sampled_from(sorted(INVALID)), max_size=2)):
        fields[name] = draw(st.sampled_from(INVALID[name]))
    return fields


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def problems(f: dict) -> set[str]:
    """The fields the oracle finds invalid (written independently of ``DSparkConfig._check``)."""
    bad = {k for k in ("vocab_size", "hidden_size", "target_num_layers", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "intermediate_size", "block_size", "sequential_rank")
           if not is_int(f[k]) or f[k] < 1}
    if is_int(f["head_dim"]) and f["head_dim"] % 2:
        bad.add("head_dim")
    if not bad & {"num_attention_heads", "hidden_size"} and f["hidden_size"] % f["num_attention_heads"]:
        bad.add("num_attention_heads")  # the message names both
    if not bad & {"num_attention_heads", "num_key_value_heads"} and f["num_attention_heads"] % f["num_key_value_heads"]:
        bad.add("num_key_value_heads")
    if f["draft_vocab_size"] is not None and not (is_int(f["vocab_size"]) and 1 <= f["draft_vocab_size"] <= f["vocab_size"]):
        bad.add("draft_vocab_size")
    if f["block_size"] in (0, 17) or not is_int(f["block_size"]):
        bad.add("block_size")
    if f["sequential_head"] not in ("none", "markov", "rnn"):
        bad.add("sequential_head")
    if f["verification"] not in ("scheduler", "async", "fixed", "threshold"):
        bad.add("verification")
    if not 0 <= f["confidence_threshold"] <= 1:  # False for NaN too
        bad.add("confidence_threshold")
    if f["confidence_head"] is not True and f["confidence_head"] is not False:
        bad.add("confidence_head")
    bad |= {k for k in ("rms_norm_eps", "rope_theta") if not 0 < f[k] < float("inf")}
    if f["dspark_version"] not in (1, 2):
        bad.add("dspark_version")
    elif (f["dspark_version"] == 1) != (f["mask_token_id"] is None) or (f["dspark_version"] == 2 and not (
            is_int(f["mask_token_id"]) and is_int(f["vocab_size"]) and 0 <= f["mask_token_id"] < f["vocab_size"])):
        bad.add("mask_token_id")
    ids = f["target_layer_ids"]
    if ids is not None and (not ids or len(set(ids)) != len(ids) or any(i < 0 for i in ids)
                            or (is_int(f["target_num_layers"]) and not all(0 <= i < f["target_num_layers"] for i in ids))):
        bad.add("target_layer_ids")
    return bad


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config_fields())
def test_config_accepts_exactly_the_valid_fields(fields):
    bad = problems(fields)
    if bad:
        with pytest.raises(ValueError) as error:
            DSparkConfig(**fields)
        assert any(name in str(error.value) for name in bad), (bad, str(error.value))
        return
    config = DSparkConfig(**fields)
    assert config.target_layer_ids, "an accepted config always has context layers"
    target = tiny_llama(config.vocab_size, config.hidden_size, config.target_num_layers, seed=0)
    drafter = DSparkDrafter(config).eval().bind(target)
    context = drafter.new_context()
    drafter.extend_context(context, torch.randn(1, 3, config.context_width))
    block = drafter.draft(context, anchor=1, block_size=config.block_size)
    assert block.tokens.shape == (config.block_size,)
    assert all(int(t) in set(drafter.draft_vocab.tolist()) for t in block.tokens)


@pytest.mark.parametrize(("field", "value"), [
    ("sequential_rank", 0), ("sequential_rank", -4), ("confidence_threshold", 1.5), ("confidence_threshold", -0.1),
    ("num_key_value_heads", 2), ("num_hidden_layers", 0), ("draft_vocab_size", 0), ("draft_vocab_size", 49153),
    ("target_layer_ids", []), ("block_size", 2.7),
])
def test_issue_cases_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DSparkConfig(**{field: value, "mask_token_id": 16})  # a valid v2 config but for that field


def test_none_layer_ids_means_the_default_spread():
    assert DSparkConfig(target_layer_ids=None, mask_token_id=16).target_layer_ids == [1, 10, 18, 27]


def test_the_layer_shapes_have_one_home():
    """``DSparkConfig.layer_config`` is the one list of layer shapes: the backbone's Llama pieces and the exported
    Qwen3 layer config are built from it, and ``layer_shapes`` reads it back (hand values, not the same call)."""
    from dspark_hf.hub.export import _layer_config
    from dspark_hf.modeling.backbone import _llama_config

    config = DSparkConfig(vocab_size=40, hidden_size=16, target_num_layers=4, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=6, intermediate_size=24, rms_norm_eps=1e-6, rope_theta=5e5,
                          max_position_embeddings=64, mask_token_id=0)
    shapes = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=6, rms_norm_eps=1e-6, max_position_embeddings=64)
    rope = {"rope_type": "default", "rope_theta": 5e5}
    assert config.layer_config() == {**shapes, "rope_parameters": rope}
    llama = _llama_config(config)
    assert {name: getattr(llama, name) for name in shapes} == shapes and llama.rope_parameters == rope
    assert _layer_config(config) == {"model_type": "qwen3", **shapes, "rope_parameters": rope, "hidden_act": "silu",
                                     "attention_bias": False, "layer_types": ["full_attention"] * 3,
                                     "tie_word_embeddings": False}
    assert DSparkConfig.layer_shapes(config.layer_config()) == {**shapes, "rope_theta": 5e5}
    legacy = {**shapes, "head_dim": None, "rope_theta": 1e4}  # older layer configs: no head_dim, top-level rope_theta
    assert DSparkConfig.layer_shapes(legacy) == {**shapes, "head_dim": 4, "rope_theta": 1e4}
