"""The sequential-head interface (paper §3.1, eq. 4): a head registered through the factory drafts, trains and runs
inside ``generate`` without any change to the drafter or the drafting code.

The toy head below is a third head that exists only here: a running sum of the previous tokens' ``W1`` rows,
``s_k = s_{k-1} + W1[x_{k-1}]``, ``B_k = s_k W2`` (a stateful head, so the state threading is exercised too).
"""

import pytest
import torch
from test_model import N_CTX, V, context_features, make_drafter, tiny_target

import dspark_hf  # noqa: F401  (routes DSpark drafters through DSparkCandidateGenerator)
from dspark_hf import DSparkConfig
from dspark_hf.modeling.heads import (
    SEQUENTIAL_HEADS,
    MarkovHead,
    RNNHead,
    SequentialHead,
    build_sequential_head,
    head_names,
    register_head,
)

pytestmark = pytest.mark.usefixtures("one_thread")


class BagHead(SequentialHead):
    """``B_k = (W1[x_0] + ... + W1[x_{k-1}]) W2``."""

    name = "bag"

    def __init__(self, rank: int, vocab: int):
        super().__init__()
        self.rank = rank
        self.w2 = torch.nn.Linear(rank, vocab, bias=False)

    @classmethod
    def from_config(cls, config):
        return cls(config.sequential_rank, config.draft_vocab_size or config.vocab_size)

    def initial_state(self, like):
        return like.new_zeros(*like.shape[:-1], self.rank)

    def step(self, state, prev_embedding, hidden):
        state = state + prev_embedding
        return state, self.w2(state)


@pytest.fixture
def bag():
    """``BagHead`` registered for one test (the registry is process-wide)."""
    register_head(BagHead)
    yield BagHead
    del SEQUENTIAL_HEADS[BagHead.name]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(1, V, (1, N_CTX + 6), generator=torch.Generator().manual_seed(7))


def test_the_factory_builds_each_registered_head(target):
    assert head_names() == ("none", "markov", "rnn")
    expected = {"none": type(None), "markov": MarkovHead, "rnn": RNNHead}
    for name, cls in expected.items():
        config = DSparkConfig.for_target(target, sequential_head=name, sequential_rank=8, mask_token_id=0)
        assert type(build_sequential_head(config)) is cls


def test_register_head_refuses_none_and_taken_names(bag):
    assert head_names() == ("none", "markov", "rnn", "bag")
    for name in ("none", "markov", "bag", ""):
        clash = type("Clash", (BagHead,), {"name": name})
        with pytest.raises(ValueError, match="new name other than 'none'"):
            register_head(clash)
    assert SEQUENTIAL_HEADS["bag"] is BagHead and SEQUENTIAL_HEADS["markov"] is MarkovHead


def test_an_unregistered_head_name_is_refused_naming_the_registered_ones(target):
    with pytest.raises(ValueError, match=r"sequential_head must be one of \('none', 'markov', 'rnn'\), got 'bag'"):
        DSparkConfig.for_target(target, sequential_head="bag", mask_token_id=0)


@pytest.mark.parametrize("head", ["markov", "rnn", "bag"])
def test_every_head_starts_with_no_bias_and_loads_its_trained_weights(target, bag, head, tmp_path):
    config = DSparkConfig.for_target(target, sequential_head=head, sequential_rank=8, mask_token_id=0)
    drafter = dspark_hf.DSparkDrafter(config)
    assert isinstance(drafter.sequential, SEQUENTIAL_HEADS[head])
    assert torch.equal(drafter.sequential.w2.weight, torch.zeros(V, 8))  # init_weights through the interface
    trained = make_drafter(target, head)
    trained.save_pretrained(tmp_path)
    loaded = dspark_hf.DSparkDrafter.from_pretrained(tmp_path)
    assert torch.equal(loaded.sequential.w2.weight, trained.sequential.w2.weight)  # the init leaves loaded W2 alone


def _bag_bias(drafter, prev_tokens):
    """``B`` ``[..., γ, V']`` by hand: the running sum of ``W1[x_{j}]``, ``j < k``, times ``W2``."""
    rows = drafter.token_table.weight[drafter.vocab_index[prev_tokens]]  # [..., γ, r]
    return rows.cumsum(-2) @ drafter.sequential.w2.weight.T


def test_a_new_head_trains_with_teacher_forcing(target, bag):
    drafter = make_drafter(target, "bag")
    hidden, prev = torch.randn(3, 5, drafter.config.hidden_size), torch.randint(0, V, (3, 5))
    out = drafter.heads(hidden, prev)
    torch.testing.assert_close(out.logits - drafter.base_logits(hidden), _bag_bias(drafter, prev))


def test_a_new_head_drafts_its_own_bias(target, prompt, bag):
    drafter = make_drafter(target, "bag")
    ctx = drafter.new_context()
    drafter.extend_context(ctx, context_features(target, drafter, prompt[:, :N_CTX]))
    anchor = int(prompt[0, N_CTX])
    block = drafter.draft(ctx, anchor, 5, do_sample=True, generator=torch.Generator().manual_seed(0))
    # the same block teacher-forced on the drafted tokens: U_k + B(x_0 .. x_{k-1}) at every position
    positions = torch.arange(N_CTX, N_CTX + 5)[None]
    hidden = drafter.backbone(drafter.block_embeddings(torch.tensor([anchor]), 5), positions, ctx.layers)[0]
    prev = torch.cat([torch.tensor([anchor]), block.tokens[:-1]])
    expected = drafter.base_logits(hidden) + _bag_bias(drafter, prev)
    torch.testing.assert_close(block.logits, expected)
    assert _bag_bias(drafter, prev).abs().amax() > 0.1  # the head really moved the logits


def test_a_new_head_is_lossless_in_generate(target, prompt, bag):
    drafter = make_drafter(target, "bag")
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                          dspark_verification="fixed", dspark_block_size=4, dspark_lookup=False)
    assert torch.equal(out, plain)


def test_a_head_the_serving_formats_lack_is_not_exported(target, bag, tmp_path):
    from dspark_hf.hub.export import export_drafter

    with pytest.raises(ValueError, match="'bag' sequential head has no counterpart in the serving formats"):
        export_drafter(make_drafter(target, "bag"), tmp_path, format="deepspec")
