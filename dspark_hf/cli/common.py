"""What every ``dspark`` command shares: argument types, location and prompt checks, target and drafter loading,
and :func:`add_command` (the shared ``--threads`` / ``--target`` / ``--drafter`` / ``--device`` options)."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

from ..defaults import DEFAULT_CPU_THREADS, check_local_path, default_drafter
from ..modeling.limits import MAX_BLOCK_SIZE

DEFAULT_THREADS = DEFAULT_CPU_THREADS  # as load_target's in Python: one cached SPS curve for both
GAMMA_HELP = (f"block size γ, drafts per round, 1..{MAX_BLOCK_SIZE} (default: the drafter's). The scheduler and async "
              "modes need a calibration covering γ: the shipped drafter's covers γ <= 7; fixed and threshold modes "
              f"take any γ up to {MAX_BLOCK_SIZE}")


def _int_in(low: int, high: int | None = None):
    """argparse type: an integer in ``low..high`` (no upper bound when ``high`` is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in {low}..{high if high is not None else ''}, got {value}")
        return value
    return parse


def _temperature(text: str) -> float:
    """argparse type: a sampling temperature >= 0 (0 = greedy)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy decoding), got {text}")
    return value


def _prompt(text: str) -> str:
    """argparse type: a prompt with some non-blank text."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty; pass the text to answer")
    return text


def check_location(value, option: str, what: str) -> None:
    """Exit with a message naming ``option`` when ``value`` is neither an existing path nor a Hub id
    (:func:`~dspark_hf.defaults.check_local_path`, the rule ``from_pretrained`` applies too)."""
    if value is None:
        return
    try:
        check_local_path(value, what)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"{option} {value}: {err}")


@contextmanager
def loading(option: str, value, what: str, default: str):
    """Turn a failed ``from_pretrained`` of ``option value`` into a one-line exit in the command's terms: a folder
    that holds no ``what``, a Hub id that could not be fetched (offline, or no such repo), or a model that is not
    what the option takes (the loader's ``ValueError``, e.g. a target folder as ``--drafter``, or a drafter that does
    not fit the target). ``default`` says what leaving the option out loads."""
    try:
        yield
    except ValueError as err:  # loaded, but not what the option takes (e.g. a target folder given as the drafter)
        if value is None:
            raise
        sys.exit(f"{option} {value}: {err}")
    except OSError as err:
        if value is None:
            raise  # the default itself failed to load: not the user's input
        if Path(value).expanduser().is_dir():
            reason = (f"this folder holds no {what} (a {what} folder has config.json and model.safetensors, as "
                      f"save_pretrained writes them): {str(err).splitlines()[0].rstrip('.')}")
        else:
            offline = "connect" in str(err) or "offline" in str(err).lower()
            reason = ("not a folder here, so it was read as a Hub id, and "
                      + ("the Hub cannot be reached (offline?)" if offline else str(err).splitlines()[0].rstrip(".")) +
                      f". Pass the path of a local {what} folder, or leave out {option} for {default}")
        sys.exit(f"{option} {value}: {reason}.")


def check_prompt_fits(prompt_length: int, max_new_tokens: int, target) -> None:
    """Exit when the prompt plus ``max_new_tokens`` exceed the target's positions (refused, not truncated)."""
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if limit is None or prompt_length + max_new_tokens <= limit:
        return
    if prompt_length >= limit:
        sys.exit(f"The prompt has {prompt_length} tokens, and the target handles {limit} positions in all: shorten "
                 f"the prompt to fewer than {limit} tokens.")
    sys.exit(f"--max-new-tokens {max_new_tokens} with this {prompt_length}-token prompt needs {prompt_length + max_new_tokens} "
             f"positions, but the target handles {limit}: pass --max-new-tokens {limit - prompt_length} or less.")


def load_cli_target(args):
    """``(target, tokenizer)`` for ``--target`` on ``--device``; on the CPU with this package's kernels
    (:func:`~dspark_hf.runtime.targets.use_cpu_kernels`) unless ``--stock-kernels``."""
    from ..runtime.targets import load_target

    check_location(args.target, "--target", "target")
    device = getattr(args, "device", "cpu")
    stock = getattr(args, "stock_kernels", False) or device != "cpu"  # CPU kernels (linears, attention, cache)
    with loading("--target", args.target, "model", "the bundled SmolLM2-135M-Instruct"):
        target, tokenizer = load_target(args.target, stock_kernels=stock, threads=None)  # --threads, set by main
    return target.to(device), tokenizer


def load_models(args, need_drafter: bool = True):
    """``(target, tokenizer, drafter)`` of ``--target`` and ``--drafter`` (default: the shipped drafter,
    :func:`~dspark_hf.defaults.default_drafter`); exits with a message when the drafter folder is missing."""
    from ..modeling.modeling_dspark import DSparkDrafter

    if need_drafter:
        check_location(args.drafter, "--drafter", "drafter")
        path = args.drafter or default_drafter()
        if args.drafter is None and not Path(path).is_dir():
            sys.exit(f"No drafter at {path}; pass --drafter PATH_OR_HUB_ID.")
    target, tokenizer = load_cli_target(args)
    drafter = None
    if need_drafter:
        with loading("--drafter", args.drafter, "drafter", "the shipped drafter"):
            drafter = DSparkDrafter.from_pretrained(path).bind(target).eval()
    return target, tokenizer, drafter


def dataclass_flags(dataclass_type) -> argparse.ArgumentParser:
    """The fields of ``dataclass_type`` as flags (transformers' ``HfArgumentParser``), for a subcommand's
    ``parents``: each flag absent unless given (its default stays the dataclass's or the config file's) and listed
    dash-spelled first (``--max-new-tokens``, as the README writes it; ``--max_new_tokens`` still works)."""
    from transformers import HfArgumentParser

    flags = HfArgumentParser(dataclass_type, add_help=False)
    for action in flags._actions:
        action.default = argparse.SUPPRESS
        action.option_strings.sort(key=lambda option: "_" in option)
    return flags


def add_command(sub, name, run, help, drafter=False, kernels=False, compute=False, parents=()):
    """A ``dspark NAME`` subparser whose ``run(args)`` is called, with the options the command shares."""
    p = sub.add_parser(name, help=help, parents=list(parents))
    p.set_defaults(fn=run)
    if compute:
        p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                       help=f"torch CPU threads (default {DEFAULT_THREADS}: torch's one-per-core default collapses "
                            "when other work shares the CPU; try more on an idle many-core machine). Part of "
                            "the SPS curve's cache key")
    p.add_argument("--target", default=None, help="target model (Hub id or folder); default: bundled SmolLM2-135M-Instruct")
    if drafter:
        p.add_argument("--drafter", default=None, help=f"drafter folder or Hub id (default {default_drafter().name})")
    if kernels:
        p.add_argument("--device", default="cpu", help="device of the target and drafter, e.g. cuda (default cpu)")
        p.add_argument("--stock-kernels", action="store_true",
                       help="run the target on transformers' stock CPU kernels (linears, SDPA attention, DynamicCache) "
                            "instead of this package's (dspark_hf.runtime.targets.use_cpu_kernels: oneDNN prepacked "
                            "linears, grouped-query SDPA, an O(new tokens) KV cache)")
    return p
