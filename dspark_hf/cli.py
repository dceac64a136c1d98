"""The ``dspark`` command line: info, generate, profile, train, calibrate, bench, card, push, demo."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from .config import MAX_BLOCK_SIZE, VERIFICATION_MODES

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DRAFTER = REPO_ROOT / "model_cards" / "dspark-smollm2-135m-instruct"
DEFAULT_TRAIN_CONFIG = REPO_ROOT / "configs" / "dspark-smollm2-135m-instruct.yaml"


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


def check_location(value, option: str) -> None:
    """Exit with a clear message when ``value`` is neither an existing folder nor a valid Hub id."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if value is None or Path(value).expanduser().exists():
        return
    try:
        validate_repo_id(str(value))
    except HFValidationError:
        sys.exit(f"{option} {value}: no such folder, and not a Hub id (ORG/NAME). Pass an existing folder or a Hub id.")


def check_prompt_fits(prompt_length: int, max_new_tokens: int, target) -> None:
    """Exit when the prompt plus ``max_new_tokens`` exceed the target's positions (refused, not truncated)."""
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and prompt_length + max_new_tokens > limit:
        sys.exit(f"The prompt has {prompt_length} tokens and --max-new-tokens asks for {max_new_tokens} more, but the "
                 f"target handles {limit} positions: shorten the prompt to at most {limit - max_new_tokens} tokens "
                 "or lower --max-new-tokens.")


def load_cli_target(args):
    """``(target, tokenizer)`` for ``--target``, on oneDNN-prepacked CPU kernels unless ``--stock-kernels``."""
    from .target import load_target

    check_location(args.target, "--target")
    return load_target(args.target, prepack=False if getattr(args, "stock_kernels", False) else None)


def _load(args, need_drafter: bool = True):
    from .model import DSparkDrafter

    if need_drafter:
        check_location(args.drafter, "--drafter")
        path = args.drafter or DEFAULT_DRAFTER
        if args.drafter is None and not Path(path).is_dir():
            sys.exit(f"No drafter at {path}; pass --drafter PATH_OR_HUB_ID.")
    target, tokenizer = load_cli_target(args)
    drafter = DSparkDrafter.from_pretrained(path).bind(target).eval() if need_drafter else None
    return target, tokenizer, drafter


def cmd_info(args):
    import torch
    import transformers

    from . import __version__
    from .target import DEFAULT_TARGET_NAME, cache_root, default_target_dir, default_target_gguf

    try:
        gguf = str(default_target_gguf())
    except (ModuleNotFoundError, FileNotFoundError) as err:
        gguf = f"missing ({err})"
    info = {
        "dspark_hf": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "default_target": DEFAULT_TARGET_NAME,
        "default_target_gguf": gguf,
        "default_target_cache": str(default_target_dir()),
        "cache_root": str(cache_root()),
        "default_drafter": str(DEFAULT_DRAFTER) if DEFAULT_DRAFTER.is_dir() else None,
    }
    print(json.dumps(info, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))


def cmd_generate(args):
    from transformers import TextStreamer

    from .data import chat_ids
    from .evaluation import timed_generate

    target, tokenizer, drafter = _load(args)
    prompt_ids = chat_ids(tokenizer, args.prompt)
    check_prompt_fits(len(prompt_ids), args.max_new_tokens, target)
    settings = {"dspark_verification": args.verify, "dspark_block_size": args.gamma, "dspark_lookup": args.lookup or None}
    settings = {k: v for k, v in settings.items() if v is not None}
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:  # DSpark's per-call checks (γ beyond the calibration, a mode the drafter lacks) raise before any compute
        if args.compare:  # one short untimed run of each first, so neither timing pays first-call costs
            timed_generate(target, prompt_ids, 8, args.temperature, drafter, **settings)
            timed_generate(target, prompt_ids, 8, args.temperature)
        run = timed_generate(target, prompt_ids, args.max_new_tokens, args.temperature, drafter, streamer, **settings)
    except ValueError as err:
        sys.exit(f"dspark generate: {err}")
    result = {
        "text": tokenizer.decode(run.tokens, skip_special_tokens=True),
        "new_tokens": len(run.tokens),
        "rounds": len(run.stats.rounds),
        "tau": run.stats.tau,
        "tokens_per_s": run.tokens_per_s,
        "sources": run.stats.token_sources(),
    }
    if args.compare:
        base = timed_generate(target, prompt_ids, args.max_new_tokens, args.temperature)
        result |= {
            "baseline_tokens_per_s": base.tokens_per_s,
            "speedup": run.tokens_per_s / base.tokens_per_s,
            "identical": base.tokens == run.tokens if args.temperature == 0 else None,
        }
    if args.json:
        print(json.dumps(result))
        return
    summary = {k: v for k, v in result.items() if k != "text"}
    print("\n---\n" + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


def cmd_profile(args):
    from .profiling import load_or_profile_sps, profile_sps

    target, _ = load_cli_target(args)
    measure = profile_sps if args.refresh else load_or_profile_sps  # profile_sps replaces the cached file
    curve = measure(target, max_tokens=args.max_tokens, context_len=args.context_len)
    if args.json:
        print(curve.to_json())
    else:
        for b, sps in enumerate(curve.steps_per_s, 1):
            print(f"B={b:3d}  {sps:8.2f} steps/s  {1e3 / sps:8.1f} ms")


def cmd_train(args):
    from .data import prepare_data
    from .target import load_target
    from .training import TrainConfig, train

    cfg = TrainConfig.from_yaml(args.config)
    if args.export_tokens:
        from .data import export_tokens

        if not cfg.tokens_file:
            sys.exit(f"--export-tokens writes the config's tokens_file, and {args.config} sets none.")
        print(f"{export_tokens(cfg.data_dir, cfg.tokens_file)} rows of {cfg.data_dir} written to {cfg.tokens_file}")
        return
    if cfg.threads:  # regeneration and training alike: pinned threads hold up when the machine is shared
        import torch

        torch.set_num_threads(cfg.threads)
    target, tokenizer = load_target(args.target)
    from .config import spread_layer_ids

    layers = spread_layer_ids(target.config.num_hidden_layers, cfg.num_context_layers)
    prepare_data(target, tokenizer, cfg.data_dir, layers, cfg.target_tokens, cfg.gen_batch_size,
                 max_new_tokens=cfg.max_new_tokens, worker=args.worker, tokens_file=cfg.tokens_file)
    if args.prepare_only:
        return
    print(f"drafter saved to {train(target, cfg, command=f'dspark train --config {args.config}')}")


def _worker(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``0 <= K < N``."""
    try:
        index, workers = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--worker takes K/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= index < workers:
        raise argparse.ArgumentTypeError(f"--worker K/N needs 0 <= K < N, got {text!r}")
    return index, workers


def cmd_calibrate(args):
    from .calibration import SequentialTemperatureScaling, reliability_diagram
    from .data import sharegpt_queue
    from .evaluation import collect_rounds

    target, tokenizer, drafter = _load(args)
    prompts = [ids for _, _, ids in sharegpt_queue(tokenizer, ("calibration",))[: args.prompts]]
    confs, accepted, _ = collect_rounds(target, drafter, prompts, args.max_new_tokens, args.temperature)
    sts = SequentialTemperatureScaling().fit(confs, accepted)
    out = Path(args.drafter or DEFAULT_DRAFTER)
    sts.save(out)
    reliability_diagram(confs, accepted, sts, out / "reliability.png")
    report = sts.fit_report
    print(json.dumps({"rounds": report["n_rounds"], "ece_before": report["mean_ece_before"],
                      "ece_after": report["mean_ece_after"], "temperatures": sts.temperatures}, indent=2))


def main(argv=None):
    """Entry point of the ``dspark`` console script."""
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, fn, help, drafter=False, kernels=False):
        p = sub.add_parser(name, help=help)
        p.set_defaults(fn=fn)
        p.add_argument("--target", default=None, help="target model (Hub id or folder); default: bundled SmolLM2-135M-Instruct")
        if drafter:
            p.add_argument("--drafter", default=None, help=f"drafter folder or Hub id (default {DEFAULT_DRAFTER.name})")
        if kernels:
            p.add_argument("--stock-kernels", action="store_true",
                           help="run the target's linear layers on torch's stock CPU kernels instead of oneDNN "
                                "prepacked ones (dspark_hf.kernels; prepacking is the default where torch has oneDNN)")
        return p

    p = command("info", cmd_info, "versions, default target and cache paths")
    p.add_argument("--json", action="store_true")

    p = command("generate", cmd_generate, "generate with DSpark speculative decoding", drafter=True, kernels=True)
    p.add_argument("prompt", type=_prompt)
    p.add_argument("--max-new-tokens", type=_int_in(1), default=128)
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy; > 0 samples at that temperature")
    p.add_argument("--gamma", type=_int_in(1, MAX_BLOCK_SIZE), default=None, help=GAMMA_HELP)
    p.add_argument("--verify", choices=VERIFICATION_MODES, default=None, help="verification mode (default: the drafter's config.verification)")
    p.add_argument("--lookup", action="store_true",
                   help="also draft n-gram continuations from the prompt and the text (dspark_lookup=True)")
    p.add_argument("--compare", action="store_true", help="also run plain generate and report the speedup")
    p.add_argument("--json", action="store_true")

    p = command("profile", cmd_profile, "measure (or show the cached) SPS curve of the target", kernels=True)
    p.add_argument("--refresh", action="store_true", help="measure again and replace the cached curve (e.g. on a quiet machine)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--json", action="store_true")

    p = command("train", cmd_train, "regenerate data with the target and train a drafter")
    p.add_argument("--config", default=str(DEFAULT_TRAIN_CONFIG))
    p.add_argument("--prepare-only", action="store_true", help="only generate and cache the training data")
    p.add_argument("--export-tokens", action="store_true",
                   help="write the token ids of data_dir's shards to the config's tokens_file (to commit) and exit")
    p.add_argument("--worker", type=_worker, default=(0, 1), metavar="K/N",
                   help="regenerate only shards i with i %% N == K, so N processes can share the work (default 0/1)")

    p = command("calibrate", cmd_calibrate, "fit Sequential Temperature Scaling on calibration rounds", drafter=True)
    p.add_argument("--prompts", type=_int_in(1), default=40)
    p.add_argument("--max-new-tokens", type=_int_in(1), default=128)
    p.add_argument("--temperature", type=_temperature, default=0.0)

    from . import bench, demo, hub

    for module in (bench, hub, demo):
        module.add_cli(sub, command)

    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
