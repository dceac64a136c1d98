"""Tests for the DSpark drafter (paper §2.2 context injection, §3.1 eqs. 4-6, §3.2.1 eq. 7).

Everything runs on CPU with a tiny random Llama target (vocab 64, d = 32, 6 layers) in a few seconds.
Drafter weights are randomised (``W2`` starts at zero, which would hide the sequential heads).
"""

import json
import warnings

import pytest
import torch
from conftest import tiny_llama
from safetensors import safe_open
from transformers import AutoConfig, AutoModel

import dspark_hf  # noqa: F401  (registers "dspark" with the Auto classes)
from dspark_hf import DSparkConfig, DSparkDrafter, SequentialTemperatureScaling
from dspark_hf.modeling.drafting import warm_up
from dspark_hf.modeling.heads import MarkovHead, RNNHead
from dspark_hf.modeling.modeling_dspark import CALIBRATION_FILE

HEADS = ("none", "markov", "rnn")
GAMMAS = (1, 7, 16)
V, D, RANK = 64, 32, 8
DRAFT_VOCAB = 40  # V' < V for the restricted-vocabulary variants
N_CTX = 11  # prompt positions whose target features form the context


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_target(vocab=V, hidden=D, layers=6, name="tiny/target"):
    return tiny_llama(vocab, hidden, layers, name=name, initializer_range=0.2, bos_token_id=1)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def make_drafter(target, head="markov", draft_vocab=None, confidence=True, seed=1, **kwargs) -> DSparkDrafter:
    """A drafter for ``target`` with every weight random (so each head really contributes)."""
    config = DSparkConfig.for_target(
        target, num_context_layers=2, num_hidden_layers=2, sequential_head=head, sequential_rank=RANK,
        block_size=7, confidence_head=confidence, draft_vocab_size=draft_vocab, **{"mask_token_id": 0, **kwargs},
    )
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.3)
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(1.0)
        if draft_vocab is not None:
            drafter.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab])
    return drafter.bind(target)


def context_features(target, drafter, ids):
    """``[1, n, m*d]`` concatenated target hidden states of the drafter's context layers (eq. 2)."""
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1] for i in drafter.config.target_layer_ids], dim=-1)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(1, V, (1, N_CTX + 6), generator=torch.Generator().manual_seed(7))


def draft_after(drafter, features, anchor, gamma, do_sample=True, seed=0):
    """Draft one block from the context ``features`` ``[1, n, m*d]``; sampling makes tokens non-trivial."""
    ctx = drafter.new_context()
    drafter.extend_context(ctx, features)
    gen = torch.Generator().manual_seed(seed)
    return drafter.draft(ctx, int(anchor), gamma, do_sample=do_sample, generator=gen)


def draft_vocab_logits(drafter, full_logits):
    return full_logits[..., drafter.draft_vocab]


# ------------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("head", HEADS)
def test_forward_and_draft_shapes(target, prompt, head, gamma):
    drafter = make_drafter(target, head)
    features = context_features(target, drafter, prompt[:, :N_CTX])
    m = len(drafter.config.target_layer_ids)
    assert m == 2 and features.shape == (1, N_CTX, m * D)

    S, A = 2, 3
    feats = features.expand(S, -1, -1)
    anchors = torch.tensor([[2, 5, N_CTX], [1, 4, 9]])
    block_tokens = torch.randint(0, V, (S, A, gamma + 1))
    out = drafter(feats, anchors, block_tokens)
    assert out.logits.shape == (S, A, gamma, V)
    assert out.confidence_logits.shape == (S, A, gamma)
    assert out.hidden.shape == (S, A, gamma, D)
    assert torch.isfinite(out.logits).all()

    block = draft_after(drafter, features, prompt[0, N_CTX], gamma)
    assert block.tokens.shape == (gamma,) and block.tokens.dtype == torch.long
    assert block.logits.shape == (gamma, V)
    assert block.confidences.shape == (gamma,)
    assert ((block.confidences > 0) & (block.confidences < 1)).all()
    assert ((block.tokens >= 0) & (block.tokens < V)).all()


@pytest.mark.parametrize("head", HEADS)
def test_shapes_with_draft_vocab_and_without_confidence(target, prompt, head):
    drafter = make_drafter(target, head, draft_vocab=DRAFT_VOCAB, confidence=False)
    assert drafter.confidence is None
    assert (drafter.token_table is None) == (head == "none")
    features = context_features(target, drafter, prompt[:, :N_CTX])
    out = drafter(features, torch.tensor([[4, N_CTX]]), torch.randint(0, V, (1, 2, 8)))
    assert out.logits.shape == (1, 2, 7, DRAFT_VOCAB)
    assert out.confidence_logits is None

    block = draft_after(drafter, features, prompt[0, N_CTX], 7)
    assert block.confidences is None
    assert block.logits.shape == (7, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[drafter.draft_vocab] = False
    assert torch.isneginf(block.logits[:, outside]).all()
    assert torch.isfinite(block.logits[:, drafter.draft_vocab]).all()
    assert torch.isin(block.tokens, drafter.draft_vocab).all()


# -------------------------------------------------------------------------------- heads, by hand
def _w1(drafter, ids):
    """``W1[x]`` read straight from the table (out-of-draft-vocab ids use the last row)."""
    rows = drafter.vocab_index[ids]
    return drafter.token_table.weight[rows]


def test_warm_up_drafts_once_per_block_size_and_draws_no_random_numbers(target, monkeypatch):
    drafter = make_drafter(target)
    real, gammas = drafter.draft, []
    monkeypatch.setattr(drafter, "draft", lambda context, anchor, gamma, *a, **k: (
        gammas.append((context.length, gamma)), real(context, anchor, gamma, *a, **k))[1])
    state = torch.random.get_rng_state()
    for gamma in (7, 7, 3, 7, 3):
        warm_up(drafter, gamma)
    assert gammas == [(8, 7), (4, 3)]  # each after a context of its own of γ + 1 positions, once per γ
    assert torch.equal(torch.random.get_rng_state(), state)  # greedy: a sampled call's draws are not shifted


@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB])
def test_markov_bias_is_w1_times_w2(target, draft_vocab):
    drafter = make_drafter(target, "markov", draft_vocab=draft_vocab)
    assert isinstance(drafter.sequential, MarkovHead)
    w2 = drafter.sequential.w2.weight  # [V', r]
    x = torch.arange(V)  # every target id, including ones outside the draft vocabulary
    expected = _w1(drafter, x) @ w2.T  # eq. 5: W1[x] W2, [V, V']
    torch.testing.assert_close(drafter.sequential(drafter.token_embedding(x)), expected)
    if draft_vocab is not None:
        outside = ~torch.isin(x, drafter.draft_vocab)
        torch.testing.assert_close(_w1(drafter, x[outside]), drafter.token_table.weight[-1].expand(int(outside.sum()), -1))

    # in the heads: logits = U + W1[x_{k-1}] W2
    hidden = torch.randn(3, 5, D)
    prev = torch.randint(0, V, (3, 5))
    out = drafter.heads(hidden, prev)
    torch.testing.assert_close(out.logits - drafter.base_logits(hidden), _w1(drafter, prev) @ w2.T)


VERSIONS = {1: dict(dspark_version=1, mask_token_id=None), 2: {}}  # make_drafter kwargs per dspark_version


@pytest.mark.parametrize("version", VERSIONS)
def test_rnn_update_matches_eq6_by_hand(target, version):
    drafter = make_drafter(target, "rnn", **VERSIONS[version])
    rnn = drafter.sequential
    assert isinstance(rnn, RNNHead)
    r = RANK
    w_g, w_c, w_o = rnn.gates.weight.split(r, dim=0)  # each [r, 2r + d]: gate, candidate, output
    assert (rnn.gates.bias is not None) == (version == 2)  # v2: biased joint projection, as the references
    b_g, b_c, b_o = rnn.gates.bias.split(r) if version == 2 else (torch.zeros(r),) * 3
    w2 = rnn.w2.weight  # [V', r]
    hidden = torch.randn(2, D)  # h_1, h_2
    x0, x1 = 17, 42

    # step 1 from s_0 = 0
    s0 = torch.zeros(r)
    z1 = torch.cat([s0, _w1(drafter, torch.tensor(x0)), hidden[0]])
    g1 = torch.sigmoid(w_g @ z1 + b_g)
    s1 = g1 * s0 + (1 - g1) * torch.tanh(w_c @ z1 + b_c)
    b1 = w2 @ torch.tanh(w_o @ z1 + b_o)
    # step 2 carries s_1
    z2 = torch.cat([s1, _w1(drafter, torch.tensor(x1)), hidden[1]])
    g2 = torch.sigmoid(w_g @ z2 + b_g)
    s2 = g2 * s1 + (1 - g2) * torch.tanh(w_c @ z2 + b_c)
    b2 = w2 @ torch.tanh(w_o @ z2 + b_o)

    state = rnn.initial_state(hidden[0])
    assert torch.equal(state, s0)
    state, bias = rnn(state, drafter.token_embedding(torch.tensor(x0)), hidden[0])
    torch.testing.assert_close(state, s1)
    torch.testing.assert_close(bias, b1)
    state, bias = rnn(state, drafter.token_embedding(torch.tensor(x1)), hidden[1])
    torch.testing.assert_close(state, s2)
    torch.testing.assert_close(bias, b2)

    # the teacher-forced heads() run the same recurrence along the block
    out = drafter.heads(hidden[None], torch.tensor([[x0, x1]]))
    bias_seen = out.logits[0] - drafter.base_logits(hidden)
    torch.testing.assert_close(bias_seen, torch.stack([b1, b2]))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("head", HEADS)
def test_confidence_is_sigmoid_of_linear_in_h_and_w1(target, prompt, head, version):
    drafter = make_drafter(target, head, **VERSIONS[version])
    proj = drafter.confidence.proj
    assert (proj.bias is not None) == (version == 2)  # eq. 7 has no bias; v2 has one, as the references
    w = proj.weight[0]
    b = proj.bias[0] if version == 2 else 0.0
    hidden = torch.randn(4, D)
    prev = torch.randint(0, V, (4,))
    expected_logit = torch.cat([hidden, _w1(drafter, prev)], dim=-1) @ w + b
    torch.testing.assert_close(drafter.confidence(hidden, drafter.token_embedding(prev)), expected_logit)
    out = drafter.heads(hidden[None], prev[None])
    torch.testing.assert_close(out.confidence_logits[0], expected_logit)

    # draft(): c_k = sigmoid(w·[h_k; W1[x_{k-1}]] + b) with x_0 = anchor and x_k the drafted tokens
    features = context_features(target, drafter, prompt[:, :N_CTX])
    anchor = int(prompt[0, N_CTX])
    block = draft_after(drafter, features, anchor, 5)
    teacher = torch.cat([torch.tensor([anchor]), block.tokens])[None, None]
    h = drafter(features, torch.tensor([[N_CTX]]), teacher).hidden[0, 0]  # [γ, d]
    prev = teacher[0, 0, :5]
    manual = torch.sigmoid(torch.cat([h, _w1(drafter, prev)], dim=-1) @ w + b)
    torch.testing.assert_close(block.confidences, manual, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ training forward == inference draft
@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB])
@pytest.mark.parametrize("head", HEADS)
def test_teacher_forced_forward_reproduces_draft(target, prompt, head, draft_vocab):
    """Teacher tokens = drafted tokens => forward() logits/confidences equal draft()'s, for several packed
    anchors at once (each block sees context < its anchor only, paper §3.3 packing)."""
    drafter = make_drafter(target, head, draft_vocab=draft_vocab)
    n = prompt.shape[1] - 1
    features = context_features(target, drafter, prompt[:, :n])  # [1, n, m*d]
    gamma = 7
    anchors = [1, 5, 9, n]  # anchor at position a is prompt token a, context = positions < a
    blocks, teacher = [], []
    for i, a in enumerate(anchors):
        anchor = int(prompt[0, a])
        block = draft_after(drafter, features[:, :a], anchor, gamma, seed=i)
        blocks.append(block)
        teacher.append(torch.cat([torch.tensor([anchor]), block.tokens]))
    out = drafter(features, torch.tensor([anchors]), torch.stack(teacher)[None])
    for i, block in enumerate(blocks):
        torch.testing.assert_close(out.logits[0, i], draft_vocab_logits(drafter, block.logits), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.sigmoid(out.confidence_logits[0, i]), block.confidences, rtol=1e-4, atol=1e-6)

    # greedy drafting takes the argmax of the same logits (teacher-forced on its own tokens)
    anchor = int(prompt[0, n])
    greedy = draft_after(drafter, features, anchor, gamma, do_sample=False)
    teacher = torch.cat([torch.tensor([anchor]), greedy.tokens])[None, None]
    logits = drafter(features, torch.tensor([[n]]), teacher).logits[0, 0]  # [γ, V']
    assert torch.equal(greedy.tokens, drafter.draft_vocab[logits.argmax(-1)])


@pytest.mark.parametrize("gamma", GAMMAS)
def test_forward_matches_draft_for_every_gamma(target, prompt, gamma):
    drafter = make_drafter(target, "rnn")
    features = context_features(target, drafter, prompt[:, :N_CTX])
    anchor = int(prompt[0, N_CTX])
    block = draft_after(drafter, features, anchor, gamma)
    teacher = torch.cat([torch.tensor([anchor]), block.tokens])[None, None]
    out = drafter(features, torch.tensor([[N_CTX]]), teacher)
    torch.testing.assert_close(out.logits[0, 0], block.logits, rtol=1e-4, atol=1e-5)


def test_context_cache_extends_incrementally(target, prompt):
    """Appending the context in chunks (as generate does) equals encoding it at once."""
    drafter = make_drafter(target, "markov")
    features = context_features(target, drafter, prompt[:, :N_CTX])
    whole, parts = drafter.new_context(), drafter.new_context()
    drafter.extend_context(whole, features)
    for lo, hi in [(0, 4), (4, 5), (5, N_CTX)]:
        drafter.extend_context(parts, features[:, lo:hi])
    assert parts.length == whole.length == N_CTX
    a = drafter.draft(whole, 3, 7, do_sample=True, generator=torch.Generator().manual_seed(0))
    b = drafter.draft(parts, 3, 7, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.confidences, b.confidences, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- save / load
def _draft_outputs(drafter, target, prompt):
    features = context_features(target, drafter, prompt[:, :N_CTX])
    return draft_after(drafter, features, prompt[0, N_CTX], 7, seed=3)


@pytest.mark.parametrize(("head", "draft_vocab"), [(h, None) for h in HEADS] + [("markov", DRAFT_VOCAB), ("rnn", DRAFT_VOCAB)])
def test_save_load_round_trip_gives_identical_drafts(target, prompt, tmp_path, head, draft_vocab):
    drafter = make_drafter(target, head, draft_vocab=draft_vocab)
    before = _draft_outputs(drafter, target, prompt)
    drafter.save_pretrained(tmp_path)

    loaded = DSparkDrafter.from_pretrained(tmp_path).eval()
    assert not loaded.is_bound
    with pytest.raises(RuntimeError, match="bind"):
        _draft_outputs(loaded, target, prompt)
    loaded.bind(target)
    saved_config = {k: v for k, v in drafter.config.to_dict().items() if k != "_name_or_path"}
    assert {k: v for k, v in loaded.config.to_dict().items() if k != "_name_or_path"} == saved_config
    assert torch.equal(loaded.draft_vocab, drafter.draft_vocab)
    assert torch.equal(loaded.vocab_index, drafter.vocab_index)
    for (name, a), (name2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert name == name2 and torch.equal(a, b), name
    after = _draft_outputs(loaded, target, prompt)
    assert torch.equal(after.tokens, before.tokens)
    # same weights; the last ulp may differ (matmul kernels depend on the memory alignment of mmap-loaded tensors)
    torch.testing.assert_close(after.logits, before.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(after.confidences, before.confidences, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB])
def test_shared_target_weights_are_not_saved_nor_parameters(target, tmp_path, draft_vocab):
    unbound = DSparkDrafter(make_drafter(target, "markov", draft_vocab=draft_vocab).config)
    keys_unbound = set(unbound.state_dict())
    drafter = make_drafter(target, "markov", draft_vocab=draft_vocab)
    assert set(drafter.state_dict()) == keys_unbound  # binding adds nothing to the state

    target_tensors = [target.get_input_embeddings().weight, target.get_output_embeddings().weight]
    target_ptrs = {t.untyped_storage().data_ptr() for t in target_tensors}
    for name, p in drafter.named_parameters():
        assert "embed_tokens" not in name and "lm_head" not in name, name
        assert p.untyped_storage().data_ptr() not in target_ptrs, name
    n_params = sum(p.numel() for p in drafter.parameters())
    assert n_params == sum(p.numel() for p in unbound.parameters())

    drafter.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    assert keys, "nothing saved"
    assert not [k for k in keys if "embed_tokens" in k or "lm_head" in k]
    assert ("draft_vocab" in keys) == (draft_vocab is not None)
    assert "vocab_index" not in keys  # derived from draft_vocab
    for k, t in tensors.items():
        for shared in target_tensors:
            assert t.shape != shared.shape or not torch.equal(t, shared.detach()), f"{k} is a copy of a target weight"
    assert keys == {k for k in drafter.state_dict() if k != "vocab_index" and (draft_vocab or k != "draft_vocab")}


# -------------------------------------------------------------------------------------- bind
def test_bind_rejects_other_vocab_size(target):
    drafter = make_drafter(target, "markov")
    other = tiny_target(vocab=V + 8)
    with pytest.raises(ValueError, match="(?i)vocab.*dspark train"):
        drafter.bind(other)


def test_bind_rejects_other_hidden_size():
    drafter = make_drafter(tiny_target(), "markov")
    other = tiny_target(hidden=48)
    with pytest.raises(ValueError, match="(?i)hidden.*dspark train"):
        drafter.bind(other)


def test_bind_rejects_target_too_shallow_for_context_layers(target):
    drafter = make_drafter(target, "markov")  # context layers [1, 3] of 6
    other = tiny_target(layers=2)
    with pytest.raises(ValueError, match="dspark train"):
        drafter.bind(other)


def test_bind_warns_on_other_target_name(target):
    drafter = DSparkDrafter(DSparkConfig.for_target(target, num_context_layers=2, num_hidden_layers=1, sequential_rank=RANK,
                                                    mask_token_id=0))
    assert drafter.config.target_name_or_path == "tiny/target"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter.bind(target)  # same name: silent
        drafter.bind(target)  # binding again is free
    renamed = tiny_target(name="someone/else")
    with pytest.warns(UserWarning, match="someone/else"):
        drafter.bind(renamed)
    unnamed = tiny_target(name="")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter.bind(unnamed)  # an in-memory target has no name to compare


def test_context_feature_width_mismatch_raises(target):
    drafter = make_drafter(target, "markov")
    width = drafter.config.context_width
    bad = torch.zeros(1, 4, width - D)
    with pytest.raises(ValueError, match=str(width)):
        drafter.encode_context(bad)
    with pytest.raises(ValueError, match="width"):
        drafter.extend_context(drafter.new_context(), bad)
    with pytest.raises(ValueError, match="width"):
        drafter(bad, torch.tensor([[2]]), torch.zeros(1, 1, 4, dtype=torch.long))


# ------------------------------------------------------------------------------- calibration
def test_calibration_json_saved_and_loaded_with_the_drafter(target, tmp_path):
    drafter = make_drafter(target, "markov")
    drafter.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / CALIBRATION_FILE).exists()
    assert DSparkDrafter.from_pretrained(tmp_path / "plain").calibration is None

    temps = [0.5, 1.25, 2.0, 3.5]
    drafter.calibration = SequentialTemperatureScaling(temperatures=temps)
    drafter.save_pretrained(tmp_path / "cal")
    payload = json.loads((tmp_path / "cal" / CALIBRATION_FILE).read_text())
    assert payload["temperatures"] == temps
    loaded = DSparkDrafter.from_pretrained(tmp_path / "cal")
    assert isinstance(loaded.calibration, SequentialTemperatureScaling)
    assert loaded.calibration.temperatures == temps
    via_auto = AutoModel.from_pretrained(tmp_path / "cal")
    assert via_auto.calibration is not None and via_auto.calibration.temperatures == temps


# -------------------------------------------------------------------------------- Auto classes
def test_auto_classes_resolve_dspark(target, tmp_path):
    config = AutoConfig.for_model("dspark", vocab_size=V, hidden_size=D, target_num_layers=6, target_layer_ids=[1, 3],
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                  num_hidden_layers=1, sequential_rank=RANK, mask_token_id=0)
    assert type(config) is DSparkConfig
    model = AutoModel.from_config(config)
    assert type(model) is DSparkDrafter

    drafter = make_drafter(target, "rnn")
    drafter.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "dspark"
    assert type(AutoConfig.from_pretrained(tmp_path)) is DSparkConfig
    loaded = AutoModel.from_pretrained(tmp_path)
    assert type(loaded) is DSparkDrafter
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


# ---------------------------------------------------------------------------- v2 vs v1 (issue #11)
def test_config_versions_validate_with_the_fix_named():
    shapes = dict(vocab_size=V, hidden_size=D, target_num_layers=6, target_layer_ids=[1, 3], num_attention_heads=4,
                  num_key_value_heads=2)  # heads that divide D (DSparkConfig checks it)
    assert DSparkConfig(**shapes, mask_token_id=5).qk_norm is True
    assert DSparkConfig(**shapes, dspark_version=1).qk_norm is False
    with pytest.raises(ValueError, match="needs mask_token_id.*for_target"):
        DSparkDrafter(DSparkConfig(**shapes))  # the config alone builds: transformers makes default configs
    with pytest.raises(ValueError, match="mask_token_id 64 must lie in 0..63"):
        DSparkConfig(**shapes, mask_token_id=V)
    with pytest.raises(ValueError, match="drop qk_norm=False"):
        DSparkConfig(**shapes, mask_token_id=5, qk_norm=False)
    with pytest.raises(ValueError, match="set dspark_version=2"):
        DSparkConfig(**shapes, dspark_version=1, mask_token_id=5)
    with pytest.raises(ValueError, match="dspark_version must be one of"):
        DSparkConfig(**shapes, dspark_version=3, mask_token_id=5)


def test_default_config_builds_and_round_trips(tmp_path):
    """transformers builds ``DSparkConfig()`` with the defaults (``to_diff_dict``, ``__repr__``, the Auto classes)."""
    config = DSparkConfig()
    assert (config.dspark_version, config.qk_norm, config.mask_token_id) == (2, True, None)
    assert config.target_layer_ids == [1, 10, 18, 27]  # spread over the default 30 layers
    assert "DSparkConfig" in repr(config)
    with_mask = DSparkConfig(mask_token_id=16)
    with_mask.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["mask_token_id"] == 16
    back = DSparkConfig.from_pretrained(tmp_path)
    assert (back.dspark_version, back.mask_token_id) == (2, 16)
    with pytest.raises(ValueError, match="needs mask_token_id"):
        DSparkDrafter(config)


def test_a_config_json_without_version_loads_as_v1(target, prompt, tmp_path):
    v1 = make_drafter(target, "markov", dspark_version=1, mask_token_id=None)
    v1.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dspark_version"] == 1
    for key in ("dspark_version", "qk_norm", "mask_token_id"):  # a config.json written before v2 existed
        del saved[key]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = DSparkDrafter.from_pretrained(tmp_path).bind(target)
    assert loaded.config.dspark_version == 1 and loaded.mask_embedding is not None
    features, anchor = context_features(target, v1, prompt[:, :N_CTX]), prompt[0, N_CTX]
    a, b = draft_after(v1, features, anchor, 7), draft_after(loaded, features, anchor, 7)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-6, atol=1e-5)  # two allocations: kernels may differ in the last bit


def test_v2_saves_its_version_and_mask_token(target, tmp_path):
    drafter = make_drafter(target, "rnn", mask_token_id=9)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["dspark_version"], saved["qk_norm"], saved["mask_token_id"]) == (2, True, 9)
    assert DSparkDrafter.from_pretrained(tmp_path).config.mask_token_id == 9


def test_v2_layer_parameters_are_named_as_transformers_qwen3():
    """The decoder layers can be initialised from a target's layers by state_dict (same names and shapes)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    drafter = make_drafter(tiny_target(), "markov")
    qwen = Qwen3DecoderLayer(Qwen3Config(hidden_size=D, intermediate_size=drafter.config.intermediate_size,
                                         num_attention_heads=drafter.config.num_attention_heads,
                                         num_key_value_heads=drafter.config.num_key_value_heads,
                                         head_dim=drafter.config.head_dim), layer_idx=0)
    ours = {k: v.shape for k, v in drafter.layers[0].state_dict().items()}
    assert ours == {k: v.shape for k, v in qwen.state_dict().items()}
    assert ours["self_attn.q_norm.weight"] == (drafter.config.head_dim,)
    drafter.layers[0].load_state_dict(qwen.state_dict())  # strict


def test_v2_mask_slots_hold_the_target_embedding_of_the_mask_token(target):
    drafter = make_drafter(target, "markov", mask_token_id=9)
    assert drafter.mask_embedding is None and "mask_embedding" not in dict(drafter.named_parameters())
    block = drafter.block_embeddings(torch.tensor([[3, 5]]), 4)  # [1, 2, γ, d]
    embed = target.get_input_embeddings().weight
    torch.testing.assert_close(block[0, 1, 0], embed[5])
    torch.testing.assert_close(block[0, :, 1:], embed[9].expand(2, 3, D), rtol=0, atol=0)


def test_v2_qk_norm_comes_before_rope_on_context_and_block_keys(target):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    drafter = make_drafter(target, "markov")
    attn = drafter.layers[0].self_attn
    hd = attn.head_dim
    x = torch.randn(1, 5, D)
    positions = torch.arange(3, 8)[None]
    cos, sin = drafter.rotary_emb(x, positions)

    def rms(t, w):  # per-head RMSNorm over head_dim, weight [hd]
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + drafter.config.rms_norm_eps) * w

    k = rms(attn.k_proj(x).view(1, 5, -1, hd), attn.k_norm.weight).transpose(1, 2)
    q = rms(attn.q_proj(x).view(1, 5, -1, hd), attn.q_norm.weight).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k_ours, v_ours = attn.key_values(x, cos, sin)  # the context keys take this path
    torch.testing.assert_close(k_ours, k)
    # block states attending to an empty context = attention over their own q/k/v
    empty = (k.new_zeros(1, k.shape[1], 0, hd), k.new_zeros(1, k.shape[1], 0, hd))
    out = attn(x, cos, sin, empty)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v_ours, enable_gqa=True)
    torch.testing.assert_close(out, attn.o_proj(ref.transpose(1, 2).reshape(1, 5, -1)))
    with torch.no_grad():
        attn.k_norm.weight.mul_(2.0)
    assert not torch.allclose(attn.key_values(x, cos, sin)[0], k_ours)


def test_a_target_folder_is_refused_as_a_drafter(tmp_path):
    """A folder of another model (here a Llama, as a converted target is) was loaded as a randomly initialised
    drafter (transformers only reported the mismatched weights); it is refused by name."""
    tiny_llama(32, 16, 2).save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match=r"is not a DSpark drafter \(its config.json has model_type 'llama'"):
        DSparkDrafter.from_pretrained(tmp_path / "target")
