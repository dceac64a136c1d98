"""The ``dspark`` command line: info, generate, profile, train, calibrate, export, import, bench, card, push, demo."""

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
    """``(target, tokenizer)`` for ``--target`` on ``--device``; on the CPU with oneDNN-prepacked kernels unless
    ``--stock-kernels``."""
    from .target import load_target

    check_location(args.target, "--target")
    device = getattr(args, "device", "cpu")
    stock = getattr(args, "stock_kernels", False) or device != "cpu"  # prepacked kernels are CPU kernels
    target, tokenizer = load_target(args.target, prepack=False if stock else None)
    return target.to(device), tokenizer


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
    if drafter.sps_curve is not None and drafter.sps_curve.observations:  # keep what this run taught the curve
        from .profiling import save_sps

        save_sps(drafter.sps_curve, target)
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


def default_max_tokens() -> int:
    """``γ + 1`` of the shipped drafter (what its scheduler reads of the SPS curve), else 8."""
    config = DEFAULT_DRAFTER / "config.json"
    return json.loads(config.read_text())["block_size"] + 1 if config.is_file() else 8


def cmd_profile(args):
    from .profiling import DEFAULT_CONTEXTS, load_or_profile_sps, plot_sps, profile_sps, sps_cache_path

    target, _ = load_cli_target(args)
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else DEFAULT_CONTEXTS
    kwargs = dict(max_tokens=args.max_tokens or default_max_tokens(), context_len=args.context_len,
                  contexts=contexts, time_budget_s=args.time_budget)
    if args.refresh:  # profile_sps replaces the cached file
        curve = profile_sps(target, **kwargs)
    else:
        curve = load_or_profile_sps(target, **kwargs)
    if args.engine_table:
        Path(args.out).write_text(json.dumps(curve.engine_table(args.engine_table), indent=2) + "\n")
        print(f"{args.engine_table} cost table ({curve.max_tokens} sizes, {curve.device_name}) written to {args.out}")
        return
    if args.json:
        print(curve.to_json())
        return
    path = sps_cache_path(target, args.context_len)
    png = plot_sps(curve, Path(args.png) if args.png else path.with_suffix(".png"))
    print(f"SPS curve of {curve.target_name or 'the target'} on {curve.device_name}, {curve.linear_kernels} kernels "
          f"(ms per verification of B tokens; {curve.observations} online refinements):")
    print(curve.table())
    print(f"cached: {path}\nplot:   {png}")


def cmd_train(args):
    from accelerate import PartialState

    from .config import spread_layer_ids
    from .data import prepare_data
    from .target import load_target
    from .training import TrainConfig, train

    cfg = TrainConfig.from_yaml(args.config)
    if args.export_tokens:
        from .data import export_tokens

        if not cfg.tokens_file:
            sys.exit(f"--export-tokens writes the config's tokens_file, and {args.config} sets none.")
        data_dir = cfg.data_dirs[0]
        print(f"{export_tokens(data_dir, cfg.tokens_file)} rows of {data_dir} written to {cfg.tokens_file}")
        return
    import torch

    if cfg.threads:  # regeneration and training alike: pinned threads hold up when the machine is shared
        torch.set_num_threads(cfg.threads)
    # this process of `accelerate launch` / torchrun, or the only one: cuda:LOCAL_RANK where there are GPUs, else
    # the CPU (accelerate runs several processes on the CPU only when told cpu=True)
    state = PartialState(cpu=not torch.cuda.is_available())
    target, tokenizer = load_target(args.target, prepack=None if state.device.type == "cpu" else False)
    target.to(state.device)
    if state.is_main_process and not args.train_only:  # one (resumable) regeneration; the others wait for its data
        layers = spread_layer_ids(target.config.num_hidden_layers, cfg.num_context_layers)
        prepare_data(target, tokenizer, cfg.data_dirs[0], layers, cfg.target_tokens, cfg.gen_batch_size,
                     max_new_tokens=cfg.max_new_tokens, worker=args.worker, tokens_file=cfg.tokens_file, replies=cfg.replies)
    state.wait_for_everyone()
    if args.prepare_only:
        return
    final = train(target, cfg, command=f"dspark train --config {args.config}")
    if state.is_main_process:
        print(f"drafter saved to {final}")


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


DEFAULT_THREADS = 1  # see the README's "Threads and load": 2 threads collapse on a shared 2-core CPU


def cmd_export(args):
    from .export import export_drafter
    from .model import DSparkDrafter

    drafter = DSparkDrafter.from_pretrained(args.drafter_dir)
    if args.format == "speculators" and drafter.config.draft_vocab_size:  # stores the target's lm_head rows
        from transformers import AutoModelForCausalLM

        from .target import load_default_target

        target = load_default_target(prepack=False)[0] if args.target is None else AutoModelForCausalLM.from_pretrained(args.target)
        drafter.bind(target)
    try:  # a v1 drafter, or one the format cannot hold exactly: the message names the fix
        out = export_drafter(drafter, args.out, args.format, verifier_name_or_path=args.verifier)
    except ValueError as err:
        sys.exit(f"dspark export: {err}")
    print(f"{args.format} checkpoint written to {out}")


def cmd_import(args):
    from .model import DSparkDrafter

    drafter = DSparkDrafter.from_pretrained(args.checkpoint)
    drafter.save_pretrained(args.out)
    print(f"dspark-hf drafter written to {args.out} (sequential head {drafter.config.sequential_head!r}, "
          f"draft vocabulary {drafter.config.draft_vocab_size or 'full'}, verification {drafter.config.verification!r})")


def main(argv=None):
    """Entry point of the ``dspark`` console script."""
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, fn, help, drafter=False, kernels=False, compute=False):
        p = sub.add_parser(name, help=help)
        p.set_defaults(fn=fn)
        if compute:
            p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                           help=f"torch CPU threads (default {DEFAULT_THREADS}: torch's one-per-core default collapses "
                                "when other work shares the CPU; try more on an idle many-core machine). Part of "
                                "the SPS curve's cache key")
        p.add_argument("--target", default=None, help="target model (Hub id or folder); default: bundled SmolLM2-135M-Instruct")
        if drafter:
            p.add_argument("--drafter", default=None, help=f"drafter folder or Hub id (default {DEFAULT_DRAFTER.name})")
        if kernels:
            p.add_argument("--device", default="cpu", help="device of the target and drafter, e.g. cuda (default cpu)")
            p.add_argument("--stock-kernels", action="store_true",
                           help="run the target's linear layers on torch's stock CPU kernels instead of oneDNN "
                                "prepacked ones (dspark_hf.kernels; prepacking is the default where torch has oneDNN)")
        return p

    p = command("info", cmd_info, "versions, default target and cache paths")
    p.add_argument("--json", action="store_true")

    p = command("generate", cmd_generate, "generate with DSpark speculative decoding", drafter=True, kernels=True,
                compute=True)
    p.add_argument("prompt", type=_prompt)
    p.add_argument("--max-new-tokens", type=_int_in(1), default=128)
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy; > 0 samples at that temperature")
    p.add_argument("--gamma", type=_int_in(1, MAX_BLOCK_SIZE), default=None, help=GAMMA_HELP)
    p.add_argument("--verify", choices=VERIFICATION_MODES, default=None, help="verification mode (default: the drafter's config.verification)")
    p.add_argument("--lookup", action="store_true",
                   help="also draft n-gram continuations from the prompt and the text (dspark_lookup=True)")
    p.add_argument("--compare", action="store_true", help="also run plain generate and report the speedup")
    p.add_argument("--json", action="store_true")

    p = command("profile", cmd_profile, "measure (or show the cached) SPS curve of the target: table + PNG",
                kernels=True, compute=True)
    p.add_argument("--refresh", action="store_true", help="measure again and replace the cached curve (e.g. on a quiet machine)")
    p.add_argument("--max-tokens", type=int, default=None, help="largest B (default: the shipped drafter's γ + 1)")
    p.add_argument("--context-len", type=int, default=256, help="context of the primary row (part of the cache key)")
    p.add_argument("--contexts", default=None,
                   help="comma-separated further context lengths (default: 256,1024,4096 where they fit)")
    p.add_argument("--time-budget", type=float, default=25.0, help="seconds for the whole measurement (default 25)")
    p.add_argument("--png", default=None, help="where to write the plot (default: next to the cached JSON)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--engine-table", choices=("sglang", "tensorrt-llm"), default=None,
                   help="write the curve as that engine's cost table (SGLang: --speculative-dspark-sps-table-path) to --out")
    p.add_argument("--out", default="sps_table.json", help="file for --engine-table")

    p = command("train", cmd_train, "regenerate data with the target and train a drafter (on a GPU where there is "
                                     "one; several processes: `accelerate launch -m dspark_hf.cli train`)")
    p.add_argument("--config", default=str(DEFAULT_TRAIN_CONFIG))
    p.add_argument("--prepare-only", action="store_true", help="only generate and cache the training data")
    p.add_argument("--train-only", action="store_true", help="train on the data already cached in data_dir (no regeneration)")
    p.add_argument("--export-tokens", action="store_true",
                   help="write the token ids of data_dir's shards to the config's tokens_file (to commit) and exit")
    p.add_argument("--worker", type=_worker, default=(0, 1), metavar="K/N",
                   help="regenerate only shards i with i %% N == K, so N processes can share the work (default 0/1)")

    p = command("calibrate", cmd_calibrate, "fit Sequential Temperature Scaling on calibration rounds", drafter=True,
                compute=True)
    p.add_argument("--prompts", type=_int_in(1), default=40)
    p.add_argument("--max-new-tokens", type=_int_in(1), default=128)
    p.add_argument("--temperature", type=_temperature, default=0.0)

    p = command("export", cmd_export, "write a v2 drafter as a speculators (vLLM) or DeepSpec (SGLang, SpecForge) checkpoint")
    p.add_argument("drafter_dir", help="dspark-hf drafter folder or Hub id")
    p.add_argument("--format", choices=("speculators", "deepspec"), required=True)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--verifier", default=None,
                   help="speculators: the verifier's Hub id or folder the engine loads (default: the drafter's target_name_or_path)")

    p = command("import", cmd_import, "convert a speculators or DeepSpec DSpark checkpoint into a dspark-hf drafter folder")
    p.add_argument("checkpoint", help="checkpoint folder or Hub id")
    p.add_argument("--out", required=True, help="output folder (loadable with DSparkDrafter.from_pretrained)")

    from . import bench, demo, hub

    for module in (bench, hub, demo):
        module.add_cli(sub, command)

    args = parser.parse_args(argv)
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    args.fn(args)


if __name__ == "__main__":
    main()
