"""``dspark generate``: one prompt with DSpark speculative decoding (``--compare`` also times plain ``generate``)."""

from __future__ import annotations

import argparse
import json
import sys

from ..modeling.limits import MAX_BLOCK_SIZE, VERIFICATION_MODES
from .common import GAMMA_HELP, _int_in, _prompt, _temperature, add_command, check_prompt_fits, load_models

NAME = "generate"
HELP = "generate with DSpark speculative decoding (--compare: also plain generate, and the speedup)"


def run(args):
    from transformers import TextStreamer

    from ..evaluation.runs import timed_generate
    from ..runtime.targets import chat_ids

    target, tokenizer, drafter = load_models(args)
    check_settings(drafter, args.verify, args.gamma, args.lookup)
    prompt_ids = chat_ids(tokenizer, args.prompt)
    check_prompt_fits(len(prompt_ids), args.max_new_tokens, target)
    settings = {"dspark_verification": args.verify, "dspark_block_size": args.gamma, "dspark_lookup": args.lookup}
    settings = {k: v for k, v in settings.items() if v is not None}
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:  # DSpark's per-call checks (γ beyond the calibration, a mode the drafter lacks) raise before any compute
        # one short untimed run first, so the timing pays no first-call costs (the first use of a scheduled mode on
        # a machine profiles the target's SPS curve, ~25 s); with --compare, of plain generate too
        timed_generate(target, prompt_ids, 8, args.temperature, drafter, **settings)
        if args.compare:
            timed_generate(target, prompt_ids, 8, args.temperature)
        run = timed_generate(target, prompt_ids, args.max_new_tokens, args.temperature, drafter, streamer, **settings)
    except ValueError as err:
        sys.exit(f"dspark generate: {err}")
    if drafter.sps_curve is not None and drafter.sps_curve.observations:  # keep what this run taught the curve
        from ..runtime.profiling import save_sps

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
    if summary.get("identical", False) is None:  # sampling: two correct runs draw different tokens
        summary["identical"] = "n/a (sampling is exact in law, not token for token)"
    print("\n---\n" + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    print("(README, \"Statistics\": what each number counts)")


def check_settings(drafter, verify: str | None, gamma: int | None, lookup: bool | None) -> None:
    """Exit, in terms of ``--verify`` / ``--gamma`` / ``--lookup``, when the drafter cannot run them (a mode without
    its confidence head or calibration, a γ beyond the calibration, lookup without calibrated confidences)."""
    from ..decoding.lookup import lookup_missing
    from ..decoding.verification import unmet_need

    mode, gamma = verify or drafter.config.verification, gamma or drafter.config.block_size
    covered = len(drafter.calibration.temperatures) if drafter.calibration is not None else 0
    chosen = f"--verify {mode}" if verify else f"the drafter's default --verify {mode}"
    need = unmet_need(drafter, mode, gamma)
    if need == "confidence":
        sys.exit(f"dspark generate: {chosen} needs a confidence head, and this drafter has none: pass --verify fixed.")
    if need == "calibration":
        sys.exit(f"dspark generate: {chosen} needs a calibrated drafter (calibration.json), and this one has none: "
                 "pass --verify fixed or --verify threshold, or fit one with `dspark calibrate`.")
    if need == "calibration_length":
        sys.exit(f"dspark generate: --gamma {gamma} is beyond this drafter's calibration (γ <= {covered}), which "
                 f"{chosen} needs at every draft position: pass --gamma {covered} or less, or --verify fixed "
                 f"(or threshold) for any γ up to {MAX_BLOCK_SIZE}.")
    if lookup and lookup_missing(drafter, gamma) is not None:
        limit = f"--gamma {covered} or less, or " if drafter.confidence is not None and covered else ""
        sys.exit(f"dspark generate: --lookup compares drafts by calibrated confidence, which this drafter lacks at "
                 f"γ = {gamma}: pass {limit}--no-lookup.")


def add_parser(sub):
    p = add_command(sub, NAME, run, HELP, drafter=True, kernels=True, compute=True)
    p.add_argument("prompt", type=_prompt, help="the user message to answer (wrapped in the target's chat template)")
    p.add_argument("--max-new-tokens", type=_int_in(1), default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy; > 0 samples at that temperature")
    p.add_argument("--gamma", type=_int_in(1, MAX_BLOCK_SIZE), default=None, help=GAMMA_HELP)
    p.add_argument("--verify", choices=VERIFICATION_MODES, default=None, help="verification mode (default: the drafter's config.verification)")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                   help="draft n-gram continuations from the prompt and the text too (dspark_lookup; default: on in the "
                        "scheduler and async modes of a calibrated drafter)")
    p.add_argument("--compare", action="store_true", help="also run plain generate and report the speedup")
    p.add_argument("--json", action="store_true", help="print one JSON object (text and statistics) instead of streaming")
    return p
