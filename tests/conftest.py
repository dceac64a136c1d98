"""Helpers shared by the test modules: tiny random Llama targets, the "cycle" target and drafter, a CPU SPS curve.

They are plain functions (``from conftest import tiny_llama``; pytest puts ``tests/`` on ``sys.path``) plus three
fixtures: ``one_thread``, which a module opts into with ``pytestmark = pytest.mark.usefixtures("one_thread")``,
``forward_calls``, which counts the forward passes of the module's ``target`` fixture, and ``kernel_choices_here`` and
``hf_home_of_the_tests``, which every test gets.
Every builder seeds torch itself, so a module gets the same weights whichever test builds them first.
"""

import os
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark_hf import DSparkConfig, DSparkDrafter, SequentialTemperatureScaling, SPSCurve
from dspark_hf.defaults import cache_root
from dspark_hf.runtime import tuning


@pytest.fixture(scope="session", autouse=True)
def hf_home_of_the_tests(tmp_path_factory):
    """The tests' own ``HF_HOME``: the user's SPS curves copied in (the default target's tests read the stored profile
    rather than time one), everything else linked (the converted target, read only). A curve a test stores (a tiny
    target's, or the real one refined online under the tests' load) stays in the copy and never reaches the user's."""
    user = cache_root()
    home = tmp_path_factory.mktemp("hf_home")
    user_home = user.parent
    for entry in user_home.iterdir() if user_home.is_dir() else ():
        if entry.name != user.name:
            (home / entry.name).symlink_to(entry)
    (home / user.name).mkdir()
    for entry in user.iterdir() if user.is_dir() else ():
        if entry.name == "sps":
            shutil.copytree(entry, home / user.name / "sps", ignore=shutil.ignore_patterns("*.png"))
        else:
            (home / user.name / entry.name).symlink_to(entry)
    before = os.environ.get("HF_HOME")
    os.environ["HF_HOME"] = str(home)
    yield home
    if before is None:
        del os.environ["HF_HOME"]
    else:
        os.environ["HF_HOME"] = before


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls are ~50x slower with 2 threads on a loaded 2-core machine (OpenMP threads wait on each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def kernel_choices_here(tmp_path, monkeypatch):
    """Kernel choices (dspark_hf.runtime.tuning) stored in the test's own folder, not in the user's HF_HOME, which the
    default target's tests still read: a fake clock's choice must not reach a real run, nor a stored choice stand in
    for a test's timing. Choices this process remembers are kept (the default target's take seconds to time)."""
    monkeypatch.setattr(tuning, "cache_root", lambda: tmp_path / "hf_home" / "dspark_hf")


@pytest.fixture
def forward_calls(target):
    """One entry per forward pass of ``target`` (the requesting module's fixture): checks that an invalid call
    fails before any compute."""
    calls = []
    handle = target.register_forward_pre_hook(lambda module, args: calls.append(1))
    yield calls
    handle.remove()


# ------------------------------------------------------------------------------------ tiny Llama
TINY_LLAMA = dict(  # what every tiny target shares unless a test says otherwise
    intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
)
LLAMA_DEFAULT_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=None)  # LlamaConfig's own special tokens


def tiny_llama(vocab_size, hidden_size, num_hidden_layers, *, seed=0, name=None, **config) -> LlamaForCausalLM:
    """A random ``LlamaForCausalLM`` in eval mode.

    Args:
        vocab_size, hidden_size, num_hidden_layers: the shape that differs from test to test.
        seed: ``torch.manual_seed`` before the weights are drawn; ``None`` draws from the global generator as it is.
        name: stored as ``config._name_or_path`` (what a drafter records as its target); ``None`` leaves it unset.
        config: other ``LlamaConfig`` fields, overriding ``TINY_LLAMA``.
    """
    if seed is not None:
        torch.manual_seed(seed)
    settings = {**TINY_LLAMA, **config}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                                         num_hidden_layers=num_hidden_layers, **settings)).eval()
    if name is not None:
        model.config._name_or_path = name
    return model


# --------------------------------------------------------------------------------- the SPS curve
# CPU-like verification cost (ms per target step for B = 1..17 tokens; transformers-5-notes.md): steep then flat
CPU_MS = [65, 109, 110, 115, 120, 126, 130, 135, 140, 146, 150, 155, 160, 165, 170, 175, 180]


def tiny_sps_curve(ms=CPU_MS) -> SPSCurve:
    """The SPS curve of target "tiny" on CPU whose verify step of ``B`` tokens takes ``ms[B - 1]`` milliseconds.

    Not refined online (``online=False``), so a test can recompute every round's schedule from it.
    """
    return SPSCurve(steps_per_s=[1000.0 / m for m in ms], target_name="tiny", device_name="cpu", dtype="float32",
                    torch_version=torch.__version__, context_len=0, n_params=0, online=False)


# ------------------------------------------------------------------------ cycle target and drafter
# A greedy target whose argmax usually follows a fixed cycle f over the vocabulary (token x -> f(x)), and
# "cheating" drafters that predict f: blocks are accepted in part, sometimes in full, and sometimes rejected.
CYCLE_VOCAB = 64  # vocabulary = width, so the embedding rows can be orthonormal
_ORDER = torch.randperm(CYCLE_VOCAB, generator=torch.Generator().manual_seed(0))
CYCLE = torch.empty(CYCLE_VOCAB, dtype=torch.long)
CYCLE[_ORDER] = _ORDER.roll(-1)  # f: one cycle through the whole vocabulary (no fixed points)
CYCLE_INV = torch.argsort(CYCLE)


def cycle_target(num_hidden_layers, alpha, scale=3.0, name=None) -> LlamaForCausalLM:
    """Llama (vocabulary and width ``CYCLE_VOCAB``) whose greedy next token is usually ``CYCLE[last token]``.

    Orthonormal embeddings, ``lm_head[y] = scale * E[f^{-1}(y)]`` and layers whose residual writes are
    scaled by ``alpha``: the layers (attention over the whole context) move the argmax off the cycle now
    and then (more layers or a larger ``alpha``: more often); logit gaps stay large, so near-ties are rare.
    """
    v = d = CYCLE_VOCAB
    target = tiny_llama(v, d, num_hidden_layers, seed=1, name=name, head_dim=16, initializer_range=0.3)
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(2)))
        target.model.embed_tokens.weight.copy_(q[:v])
        target.lm_head.weight.copy_(scale * q[:v][CYCLE_INV])
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(alpha)
            layer.mlp.down_proj.weight.mul_(alpha)
    return target


def cycle_drafter(target, head="markov", beta=100.0, block_size=4, version=2, **config) -> DSparkDrafter:
    """A "cheating" drafter for ``cycle_target`` that predicts ``CYCLE`` from the target's last layer.

    ``W1`` = one-hot rows (rank = V); markov: ``W2`` maps x to a +beta bias on f(x) (eq. 5); rnn: the output
    gate copies ``W1[x]`` (tanh(20) ≈ 1) and ``W2`` maps it the same way (eq. 6); none: the backbone is an
    identity (zeroed residual writes) so position 1 predicts f(anchor) through the target's lm_head.
    Confidences depend on the previous token with a spread of logits, so ℓ varies in threshold/scheduler.
    ``version``: ``dspark_version`` (2: QK-norm, mask slots = the target's embedding of token 0, head biases).
    ``config`` overrides ``DSparkConfig`` fields; the drafter has no calibration and no SPS curve.
    """
    v = d = CYCLE_VOCAB
    config = DSparkConfig.for_target(target, target_layer_ids=[target.config.num_hidden_layers - 1],
                                     num_hidden_layers=1, sequential_head=head, sequential_rank=v,
                                     block_size=block_size, dspark_version=version,
                                     **{"mask_token_id": 0 if version >= 2 else None, **config})
    torch.manual_seed(3)
    drafter = DSparkDrafter(config).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        drafter.token_table.weight.zero_()
        drafter.token_table.weight[:v] = torch.eye(v)
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        to_next = beta * torch.eye(v)[CYCLE_INV]  # row y = beta * e_{f^{-1}(y)}
        if head == "markov":
            drafter.sequential.w2.weight.copy_(to_next)
        elif head == "rnn":
            drafter.sequential.gates.weight.normal_(0.0, 0.1, generator=g)
            drafter.sequential.gates.weight[2 * v:, v:2 * v] = 20.0 * torch.eye(v)
            drafter.sequential.w2.weight.copy_(to_next)
        if drafter.confidence is not None:
            drafter.confidence.proj.weight.zero_()
            drafter.confidence.proj.weight[0, d:] = 2.5 * torch.randn(v, generator=g)
            drafter.confidence.proj.weight[0, d:] += 1.0  # W1 rows are one-hot: +1 on every logit (v1 has no bias)
    return drafter


def scheduled_cycle_drafter(target, block_size=4) -> DSparkDrafter:
    """``cycle_drafter`` (markov head) ready for the scheduled modes: STS at temperature 1 (the identity) and the
    CPU-like SPS curve of :func:`tiny_sps_curve`."""
    drafter = cycle_drafter(target, block_size=block_size)
    drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * block_size)
    drafter.set_sps_curve(tiny_sps_curve())
    return drafter
