"""``torch.compile`` on a target whose linears are oneDNN-prepacked (issue 25).

``load_default_target()`` prepacks every linear (``dspark_hf.runtime.kernels``); inductor cannot lower the packed
op (``mkldnn._linear_pointwise``), so under compilation the packed layers run ``F.linear`` and inductor packs the
weights its own way. Checked: a compiled prepacked target generates what the eager one does, alone and as the
verifier of DSpark, and the compiled default target generates.
"""

import pytest
import torch
from conftest import CYCLE_VOCAB, cycle_target
from test_generation import ready_cycle_drafter

import dspark_hf
from dspark_hf import prepack_linears
from dspark_hf.runtime.targets import chat_ids

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 8


def compiled(model):
    """The issue's recipe: compile the forward in place (inductor, the default backend)."""
    model.forward = torch.compile(model.forward)
    return model


def test_compiled_prepacked_target_generates_as_eager():
    eager = prepack_linears(cycle_target(num_hidden_layers=1, alpha=0.026))
    target = compiled(prepack_linears(cycle_target(num_hidden_layers=1, alpha=0.026)))  # same seeds: same weights
    drafter = ready_cycle_drafter(eager, "markov")
    prompt = torch.randint(1, CYCLE_VOCAB, (1, 5), generator=torch.Generator().manual_seed(5))
    plain = eager.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False), plain)
    for gamma in (2, 5):
        out = target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter,
                              dspark_verification="fixed", dspark_block_size=gamma)
        assert torch.equal(out, plain), f"γ={gamma}"


def test_compiled_default_target_generates():
    """The issue's failure: ``InductorError ... mkldnn._linear_pointwise`` on the first call."""
    eager, tokenizer = dspark_hf.load_default_target()
    ids = torch.tensor([chat_ids(tokenizer, "Count from 1 to 20.")])
    plain = eager.generate(ids, max_new_tokens=2, do_sample=False)
    target = compiled(eager)
    assert torch.equal(target.generate(ids, max_new_tokens=2, do_sample=False), plain)
