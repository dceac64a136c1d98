"""``dspark bench``: one command, one run, the paper's §4 measurements on this machine.

What is measured (paper §4; symbols as in :mod:`dspark_hf.calibration`):

1. τ, accepted length per round INCLUDING the bonus token, under fixed-length verification (every
   round verifies all γ drafts: the Table 1 protocol), greedy and T = 1 sampling, per suite and as
   the macro average over suites; ``tau_ratio_dspark_over_dflash`` = macro τ(dspark) / macro τ(dflash).
2. Position-wise conditional acceptance P(n >= k | n >= k-1) from the same fixed rounds (Fig. 2).
3. Confidence: ECE of the prefix survival a_k before / after STS, ROC-AUC of c_k per position, and a
   static threshold sweep replayed offline on the recorded fixed rounds (Fig. 5).
4. Wall clock, greedy: tokens/s and speedup over plain ``generate`` of plain, prompt lookup, the
   built-in ``speculation_type="dflash"`` path (parallel drafters, through :class:`BuiltinDFlashAdapter`),
   every drafter's verification modes and each calibrated drafter's hybrid with prompt lookup
   (``<drafter>:<mode>+lookup``, :mod:`dspark_hf.lookup`); methods interleaved prompt by prompt, every greedy
   speculative output checked token-identical to plain ``generate``, and the share of each method's tokens that
   came from lookup, DSpark and the target reported.
5. The machine's SPS curve and each drafter's cost per round (median draft ms vs verify ms).

Layout: suites (prompt sources) -> pure metrics -> runner -> report (JSON, Markdown, PNG). The runner
works on token ids only, so tests drive it with a tiny random model. It makes three passes over the prompts:

1. one fixed-length generation at T = 1 per drafter and prompt (τ and acceptance at T = 1);
2. every timed greedy method but the threshold mode, interleaved prompt by prompt; the ``<drafter>:fixed``
   runs double as the greedy fixed-length rounds (greedy decoding is deterministic), which give greedy τ,
   acceptance, calibration and the threshold sweep;
3. the threshold mode at the best t of that sweep, interleaved with plain again; skipped when the best t
   is 0, which keeps every draft and so is the fixed mode.

Suites: ``code`` = HumanEval; ``chat`` = held-out ShareGPT (``sharegpt_prompts("test")``, never
train/validation/calibration) minus the math ones; ``math`` = the held-out ShareGPT conversations that
:func:`is_math_problem` accepts; ``custom`` = a JSONL file of ``{"prompt": ...}`` lines.

Budget of the defaults (``BenchSettings``: 4 prompts per suite, 96 new tokens, three drafters) on a 2-core
CPU where plain greedy runs at ~20 tok/s: 3 + 12 (+ 3) generations per prompt (two of them the ``+lookup``
hybrids), 12 prompts x ~15 generations x ~5 s ≈ 14-17 min. ``--limit N`` is a quick run at 32 new tokens (see :func:`settings_from_args`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..defaults import resolve_checkout_path
from ..metrics import conditional_acceptance, tau

SUITES = ("code", "chat", "math")
DEFAULT_THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(10))  # 0, 0.1, ..., 0.9 (paper Fig. 5)
SCHEMA_VERSION = 1

# ------------------------------------------------------------------------------------------ suites
def read_prompts_file(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(id, prompt)`` pairs of a JSONL file with one ``{"prompt": ...}`` object per line (``id`` optional).

    Raises:
        ValueError: a non-empty line that is not a JSON object with a string ``prompt``.
    """
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: expected a JSON object with a string 'prompt', got {line[:80]!r}")
        pairs.append((str(record.get("id", number)), record["prompt"]))
    return pairs


def suite_texts(names: Sequence[str], prompts_file: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """``{suite: [(id, prompt), ...]}`` in each source's fixed order (no token filter, no limit yet).

    Raises:
        ValueError: an unknown suite, or ``custom`` without ``prompts_file``.
    """
    from ..training.data import humaneval_prompts, is_math_problem, sharegpt_prompts

    unknown = set(names) - {*SUITES, "custom"}
    if unknown:
        raise ValueError(f"unknown suites {sorted(unknown)}; choose from {[*SUITES, 'custom']}")
    held_out = sharegpt_prompts("test") if {"chat", "math"} & set(names) else []
    sources = {
        "code": lambda: humaneval_prompts(),
        "chat": lambda: [(i, p) for i, p in held_out if not is_math_problem(p)],
        "math": lambda: [(i, p) for i, p in held_out if is_math_problem(p)],
        "custom": lambda: read_prompts_file(prompts_file),
    }
    if "custom" in names and prompts_file is None:
        raise ValueError("the custom suite needs --prompts FILE.jsonl")
    return {name: sources[name]() for name in names}


def encode_suites(tokenizer, texts: dict[str, list[tuple[str, str]]], limit: int, max_prompt_tokens: int):
    """The first ``limit`` prompts of each suite whose chat-formatted ids fit ``max_prompt_tokens``.

    Returns:
        ``({suite: [(id, ids), ...]}, {suite: n_skipped_too_long})``.
    """
    from ..training.data import chat_ids

    suites, skipped = {}, {}
    for name, pairs in texts.items():
        kept, skipped[name] = [], 0
        for record_id, prompt in pairs:
            if len(kept) == limit:
                break
            ids = chat_ids(tokenizer, prompt)
            if len(ids) > max_prompt_tokens:
                skipped[name] += 1
                continue
            kept.append((record_id, ids))
        suites[name] = kept
    return suites, skipped


# ---------------------------------------------------------------------------------- pure metrics
# (τ and conditional acceptance: dspark_hf.metrics, imported above)
def _prefix_length(confidences: Sequence[float], threshold: float) -> int:
    """ℓ = longest prefix with every ``c_k >= threshold`` (the ``"threshold"`` verification mode)."""
    length = 0
    for c in confidences:
        if c < threshold:
            break
        length += 1
    return length


def threshold_sweep(confidences: Sequence[Sequence[float]], accepted: Sequence[int], thresholds: Sequence[float],
                    step_seconds: Sequence[float] | None = None) -> list[dict]:
    """Static-threshold verification replayed on fixed-length rounds (paper Fig. 5).

    A round verified with prefix ℓ accepts ``min(n, ℓ)`` drafts (acceptance is a prefix; exact for greedy
    decoding, the coupled estimate for sampling) and rejects ``ℓ - min(n, ℓ)``. Threshold 0 is fixed
    verification.

    Args:
        confidences: raw ``c_k`` per round, ``N`` rows of γ values.
        accepted: drafts accepted per round under fixed verification, ``N`` values in ``0..γ``.
        thresholds: the thresholds ``t`` to replay.
        step_seconds: optional ``step_seconds[ℓ]`` = seconds of one round that verifies ℓ drafts (draft
            cost + ``1 / SPS(ℓ + 1)``), ``ℓ = 0..γ``; adds ``modelled_tokens_per_s``.

    Returns:
        One dict per threshold: ``threshold``, ``rounds``, ``accepted_per_step`` (``mean(min(n, ℓ) + 1)``,
        bonus included, = τ), ``rejected_per_step``, ``verified_per_step`` (mean ℓ), ``acceptance_rate``
        (``Σ(min(n, ℓ) + 1) / Σ(ℓ + 1)``, bonus included as in the paper), ``draft_acceptance_rate``
        (``Σ min(n, ℓ) / Σ ℓ``, ``None`` when nothing is verified) and optionally ``modelled_tokens_per_s``.
    """
    if len(confidences) != len(accepted):
        raise ValueError(f"{len(confidences)} confidence rows but {len(accepted)} accepted counts")
    n_rounds, rows = len(accepted), []
    for t in thresholds:
        lengths = [_prefix_length(c, t) for c, n in zip(confidences, accepted)]
        kept = [min(n, length) for n, length in zip(accepted, lengths)]
        row = dict(
            threshold=t,
            rounds=n_rounds,
            accepted_per_step=sum(k + 1 for k in kept) / n_rounds if n_rounds else None,
            rejected_per_step=sum(ell - k for ell, k in zip(lengths, kept)) / n_rounds if n_rounds else None,
            verified_per_step=sum(lengths) / n_rounds if n_rounds else None,
            acceptance_rate=sum(k + 1 for k in kept) / (sum(lengths) + n_rounds) if n_rounds else None,
            draft_acceptance_rate=sum(kept) / sum(lengths) if sum(lengths) else None,
        )
        if step_seconds is not None and n_rounds:
            row["modelled_tokens_per_s"] = sum(k + 1 for k in kept) / sum(step_seconds[ell] for ell in lengths)
        rows.append(row)
    return rows


def best_threshold(sweep: Sequence[dict]) -> float | None:
    """The threshold with the highest ``modelled_tokens_per_s`` (the lowest one on ties); ``None`` if unmodelled."""
    scored = [r for r in sweep if r.get("modelled_tokens_per_s") is not None]
    return max(scored, key=lambda r: (r["modelled_tokens_per_s"], -r["threshold"]))["threshold"] if scored else None


def full_rounds(stats_list, gamma: int) -> tuple[list[int], list[list[float]]]:
    """Rounds that verified all γ drafts, pooled over generations: ``(accepted, confidences)``.

    The last round of every generation is dropped (EOS or the token budget may cut its acceptance short),
    as :meth:`dspark_hf.GenerationStats.full_rounds` does; ``confidences`` is empty for drafters without a
    confidence head.
    """
    accepted, confidences = [], []
    for stats in stats_list:
        for r in stats.rounds[:-1]:
            if r.drafted == r.scheduled == gamma and not r.lookup:  # lookup tokens are not the drafter's
                accepted.append(r.accepted)
                if r.confidences:
                    confidences.append(list(r.confidences))
    return accepted, confidences


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of two sequences (a length difference counts), ``None`` if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def confidence_summary(confidences: Sequence[Sequence[float]], accepted: Sequence[int], calibration,
                       n_bins: int = 15) -> dict | None:
    """ECE of ``a_k`` before / after STS and ROC-AUC of ``c_k`` per position (paper §4, Fig. 6).

    A thin view of :meth:`dspark_hf.SequentialTemperatureScaling.report`; ``None`` without rounds.
    """
    if not confidences:
        return None
    report = calibration.report(torch.tensor(confidences, dtype=torch.float64), torch.tensor(accepted), n_bins)
    keys = ("position", "temperature", "survival_rate", "ece_before", "ece_after", "roc_auc", "n_conditional")
    return {
        "rounds": report["n_rounds"],
        "mean_ece_before": report["mean_ece_before"],
        "mean_ece_after": report["mean_ece_after"],
        "positions": [{k: p[k] for k in keys} for p in report["positions"]],
    }


# ------------------------------------------------------------------------ built-in DFlash adapter
class BuiltinDFlashAdapter(torch.nn.Module):
    """A parallel DSpark drafter (``sequential_head="none"``) behind transformers' built-in DFlash interface.

    ``target.generate(..., assistant_model=adapter, speculation_type="dflash")`` runs transformers' own
    ``DFlashTokenCandidateGenerator``: it feeds ``[anchor, mask x (block_size - 1)]`` embeddings plus the
    target features of the newly accepted positions and drafts ``argmax lm_head(last_hidden_state[:, 1:])``.
    Our drafter predicts draft k from block slot k - 1 (the anchor is prediction slot 1), so the adapter
    declares ``block_size = γ + 1`` and returns ``[h_1, h_1, ..., h_γ]`` (slot 0 is never read). What differs
    from the drafter's own path, by construction of the built-in one:

    * the mask slots use the drafter's :meth:`~dspark_hf.model.DSparkDrafter.mask_vector` (v2: the target's
      embedding of ``mask_token_id``, as the built-in path; v1: the learned mask embedding, with
      ``mask_token_id = 0`` a placeholder the adapter never reads);
    * logits come from the target's FULL lm_head, so a restricted draft vocabulary is not enforced;
    * the context K/V live in the drafter's own :class:`~dspark_hf.model.DraftContext` (reset whenever the
      generator brings a new ``DFlashCache``, i.e. per ``generate`` call), which holds accepted positions
      only, so the generator's ``cache.crop`` has nothing to remove.

    Attributes:
        rounds: forward calls (= drafted blocks) since the last ``generate`` started.
    """

    def __init__(self, drafter, gamma: int):
        super().__init__()
        if drafter.config.sequential_head != "none":
            raise ValueError("the built-in DFlash path has no sequential head; adapt only parallel drafters "
                             f"(sequential_head='none'), not {drafter.config.sequential_head!r}")
        self.drafter = drafter
        self.config = copy.deepcopy(drafter.config)
        self.config.block_size = gamma + 1  # anchor slot + γ draft slots
        if self.config.mask_token_id is None:  # v1: a placeholder, the mask slots use drafter.mask_vector()
            self.config.mask_token_id = 0
        self._cache, self._context, self.rounds = None, None, 0

    @property
    def device(self) -> torch.device:
        return self.drafter.context_proj.weight.device

    @torch.no_grad()
    def forward(self, noise_embeds, context_hidden_states, position_ids, attention_mask=None, cache=None, **kwargs):
        """``noise_embeds`` ``(1, γ + 1, d)`` and ``context_hidden_states`` ``(1, n_new, m*d)`` of the newly
        accepted positions -> ``BaseModelOutput`` whose ``last_hidden_state`` is ``(1, γ + 1, d)``."""
        from transformers.modeling_outputs import BaseModelOutput

        if cache is None or cache is not self._cache:  # a new generate call
            self._cache, self._context, self.rounds = cache, self.drafter.new_context(), 0
        context = self._context
        self.drafter.extend_context(context, context_hidden_states.to(self.drafter.context_proj.weight.dtype))
        gamma = noise_embeds.shape[1] - 1
        anchor_position = int(position_ids[0, -(gamma + 1)])
        if anchor_position != context.length:
            raise RuntimeError(f"built-in DFlash positions out of step: anchor at {anchor_position}, "
                               f"drafter context holds {context.length} positions")
        d = noise_embeds.shape[-1]
        mask = self.drafter.mask_vector()
        block = torch.cat([noise_embeds[:, :1].to(mask.dtype), mask.expand(1, gamma - 1, d)], dim=1)  # (1, γ, d)
        positions = torch.arange(context.length, context.length + gamma, device=block.device)[None]  # (1, γ)
        hidden = self.drafter.backbone(block, positions, context.layers)  # (1, γ, d)
        self.rounds += 1
        return BaseModelOutput(last_hidden_state=torch.cat([hidden[:, :1], hidden], dim=1))  # (1, γ + 1, d)


# ------------------------------------------------------------------------------------------ runner
@dataclass
class BenchSettings:
    """What one bench run does: ``dspark bench`` flags of the same names (``HfArgumentParser``, see
    :mod:`dspark_hf.cli.bench`)."""

    gamma: int = field(default=7, metadata={"help": "drafts per round γ (default: 7, as paper Table 1)"})
    max_new_tokens: int = field(default=96, metadata={"help": "new tokens per generation (default: 96; 32 with --limit)"})
    limit: int = field(default=4, metadata={  # the default run (3 suites, 3 drafters) takes ~12 min on 2 CPU cores
        "help": "prompts per suite; giving it makes a quick run at 32 new tokens unless --max-new-tokens is given "
                "too (default: the full run, 4 prompts per suite at 96 tokens)"})
    max_prompt_tokens: int = field(default=320, metadata={  # the training data used <= 320
        "help": "skip longer chat-formatted prompts (default: 320)"})
    thresholds: list[float] = field(default_factory=lambda: list(DEFAULT_THRESHOLDS), metadata={
        "help": "static thresholds of the sweep (paper Fig. 5; default 0, 0.1, ..., 0.9)"})
    sampling_temperature: float = field(default=1.0, metadata={"help": "temperature of the sampled τ pass (the T = 1 "
                                                                       "protocol of paper §4.1)"})
    prompt_lookup_num_tokens: int = field(default=7, metadata={
        "aliases": ["--prompt-lookup"],  # transformers' PromptLookupCandidateGenerator baseline
        "help": "prompt_lookup_num_tokens of the prompt-lookup baseline (default: 7)"})
    warmup_tokens: int = field(default=8, metadata={"help": "one untimed generation of this length per method before "
                                                            "pass 2 (default 8)"})

    def __post_init__(self):
        for name, value, least in (("gamma", self.gamma, 1), ("max_new_tokens", self.max_new_tokens, 2),
                                   ("limit", self.limit, 1)):
            if value < least:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= {least}, got {value}")


@dataclass
class Method:
    """One timed greedy decoding method of pass 2.

    Attributes:
        name: ``plain``, ``prompt-lookup``, ``<drafter>:<mode>`` or ``<drafter>:builtin-dflash``.
        drafter: the DSpark drafter's name, or ``None``.
        kwargs: extra ``generate`` keyword arguments.
        adapter: the :class:`BuiltinDFlashAdapter` of a built-in DFlash method.
    """

    name: str
    drafter: str | None = None
    kwargs: dict = field(default_factory=dict)
    adapter: BuiltinDFlashAdapter | None = None

    def run(self, target, ids, max_new_tokens, drafters, seed=0):
        from ..evaluation.runs import timed_generate

        drafter = drafters[self.drafter] if self.drafter and self.adapter is None else None
        run = timed_generate(target, ids, max_new_tokens, 0.0, drafter, seed=seed, **self.kwargs)
        if self.adapter is not None:  # τ estimate: the prefill token is not a round
            run.builtin_rounds = self.adapter.rounds
        return run


def modes_of(drafter) -> list[str]:
    """Verification modes a drafter can run: fixed always; the others need the confidence head."""
    return ["fixed", "threshold", "scheduler", "async"] if drafter.confidence is not None else ["fixed"]


def lookup_mode_of(drafter, gamma: int) -> str | None:
    """Verification mode of a drafter's hybrid method (``dspark_lookup=True``, :mod:`dspark_hf.lookup`): its
    config's mode when that is a scheduled one, else ``"async"``; ``None`` without calibrated confidences for γ."""
    from ..modeling.configuration_dspark import SCHEDULED_MODES

    calibration = drafter.calibration
    if drafter.confidence is None or calibration is None or len(calibration.temperatures) < gamma:
        return None
    return drafter.config.verification if drafter.config.verification in SCHEDULED_MODES else "async"


def plan_methods(drafters: dict, adapters: dict, settings: BenchSettings) -> list[Method]:
    """Pass-2 methods: plain, prompt lookup, built-in DFlash, then every drafter's modes but ``threshold``, and
    its hybrid with prompt lookup ``<drafter>:<mode>+lookup`` (see :func:`lookup_mode_of`).

    The threshold mode needs the best t of the sweep over pass 2's fixed rounds: see :func:`threshold_methods`.
    """
    lookup = {"prompt_lookup_num_tokens": settings.prompt_lookup_num_tokens}
    methods = [Method("plain"), Method("prompt-lookup", kwargs=lookup)]
    for name, adapter in adapters.items():
        methods.append(Method(f"{name}:builtin-dflash", name,
                              {"assistant_model": adapter, "speculation_type": "dflash"}, adapter))
    for name, drafter in drafters.items():
        for mode in modes_of(drafter):
            if mode != "threshold":
                methods.append(Method(f"{name}:{mode}", name,
                                      {"dspark_verification": mode, "dspark_block_size": settings.gamma}))
        mode = lookup_mode_of(drafter, settings.gamma)
        if mode is not None:
            methods.append(Method(f"{name}:{mode}+lookup", name, {
                "dspark_verification": mode, "dspark_block_size": settings.gamma, "dspark_lookup": True}))
    return methods


def threshold_methods(thresholds: dict, settings: BenchSettings) -> list[Method]:
    """Pass-3 methods: each drafter's ``threshold`` mode at its best t > 0.

    t = 0 keeps every draft, which is the ``fixed`` mode already timed in pass 2, and ``None`` (no modelled
    sweep) has nothing to run: both are left out.
    """
    return [Method(f"{name}:threshold", name, {"dspark_verification": "threshold", "dspark_block_size": settings.gamma,
                                               "dspark_threshold": t})
            for name, t in thresholds.items() if t]


def _log_default(*args):
    print(*args, file=sys.stderr, flush=True)


def sampled_rounds_pass(target, drafters, suites, settings: BenchSettings, log=_log_default) -> dict:
    """Pass 1: one fixed-length generation at T = ``settings.sampling_temperature`` per drafter and prompt.

    The greedy fixed-length rounds need no pass of their own: see :func:`greedy_rounds`.

    Returns:
        ``{drafter: {suite: [GenerationStats, ...]}}``.
    """
    from ..evaluation.runs import timed_generate

    out = {d: {s: [] for s in suites} for d in drafters}
    for suite, prompts in suites.items():
        for index, (prompt_id, ids) in enumerate(prompts):
            for name, drafter in drafters.items():
                run = timed_generate(target, ids, settings.max_new_tokens, settings.sampling_temperature, drafter,
                                     seed=index, dspark_verification="fixed", dspark_block_size=settings.gamma)
                out[name][suite].append(run.stats)
                log(f"[rounds] {suite} {index + 1}/{len(prompts)} {name} t1: τ={run.stats.tau:.2f} "
                    f"({len(run.tokens)} tok, {run.seconds:.1f} s)")
    return out


def greedy_rounds(records: dict, drafters) -> dict:
    """The greedy fixed-length rounds of the Table 1 protocol, taken from pass 2's ``<drafter>:fixed`` runs.

    Greedy decoding is deterministic, so the timed ``fixed`` run of a prompt is that prompt's τ run; running
    it again untimed would repeat the same rounds.

    Returns:
        ``{drafter: {suite: [GenerationStats, ...]}}``, as :func:`sampled_rounds_pass`.
    """
    return {name: {suite: [p["runs"][f"{name}:fixed"].stats for p in prompts] for suite, prompts in records.items()}
            for name in drafters}


def wall_clock_pass(target, drafters, methods: list[Method], suites, settings: BenchSettings, log=_log_default) -> dict:
    """Passes 2 and 3: every method on every prompt, interleaved (order rotated per prompt), greedy.

    Returns:
        ``{suite: [{"id", "prompt_tokens", "runs": {method: {"tokens", "seconds", "stats"|"builtin_rounds"}}}]}``.
    """
    first = next((p for prompts in suites.values() for p in prompts), None)
    if first is not None and settings.warmup_tokens > 0:  # allocator, kernels and lazy SPS profiling, untimed
        for method in methods:
            method.run(target, first[1], settings.warmup_tokens, drafters)
    out = {}
    counter = 0
    for suite, prompts in suites.items():
        out[suite] = []
        for index, (prompt_id, ids) in enumerate(prompts):
            shift = counter % len(methods)
            counter += 1
            runs = {}
            for method in methods[shift:] + methods[:shift]:
                runs[method.name] = method.run(target, ids, settings.max_new_tokens, drafters)
            plain = runs["plain"]
            log(f"[wall] {suite} {index + 1}/{len(prompts)}: plain {plain.tokens_per_s:.1f} tok/s; " + ", ".join(
                f"{m.name} x{runs[m.name].tokens_per_s / plain.tokens_per_s:.2f}" for m in methods[1:]))
            out[suite].append({"id": prompt_id, "prompt_tokens": len(ids), "runs": runs})
    return out


def _rounds_of_run(run) -> int | None:
    return len(run.stats.rounds) if run.stats is not None else getattr(run, "builtin_rounds", None)


def _tau_of_run(run) -> float | None:
    """τ of a speculative run; for the built-in DFlash path ``(new tokens - 1) / rounds`` (the prefill token is
    not a round; a final plain step when one token is left is counted in, so it can exceed the true τ slightly)."""
    if run.stats is not None:
        return run.stats.tau
    rounds = getattr(run, "builtin_rounds", None)
    return (len(run.tokens) - 1) / rounds if rounds else None


def summarize_wall_clock(records: dict, methods: list[Method], log=_log_default) -> tuple[dict, list[dict]]:
    """Per suite and method: median tok/s, speedups, τ, mismatches against plain greedy output.

    Returns:
        ``(summary, mismatches)``; every mismatch is also logged.
    """
    summary, mismatches = {}, []
    for suite, prompts in records.items():
        per_method = {}
        for method in methods:
            rows = []
            for p in prompts:
                run, plain = p["runs"][method.name], p["runs"]["plain"]
                where = first_divergence(run.tokens, plain.tokens)
                if where is not None:
                    mismatches.append({"suite": suite, "prompt": p["id"], "method": method.name, "position": where,
                                       "tokens": len(run.tokens), "plain_tokens": len(plain.tokens)})
                    log(f"MISMATCH {suite}/{p['id']} {method.name}: differs from plain greedy at new token {where}")
                rows.append({
                    "id": p["id"],
                    "new_tokens": len(run.tokens),
                    "seconds": run.seconds,
                    "tokens_per_s": run.tokens_per_s,
                    "speedup": run.tokens_per_s / plain.tokens_per_s,
                    "tau": _tau_of_run(run),
                    "rounds": _rounds_of_run(run),
                    "identical": where is None,
                })
            plain_median = median([p["runs"]["plain"].tokens_per_s for p in prompts])
            tps = median([r["tokens_per_s"] for r in rows])
            stats = [p["runs"][method.name].stats for p in prompts if p["runs"][method.name].stats is not None]
            per_method[method.name] = {
                "median_tokens_per_s": tps,
                "median_speedup": median([r["speedup"] for r in rows]),  # median of per-prompt ratios
                "speedup_of_medians": tps / plain_median if tps and plain_median else None,
                "tau": pooled_tau(rows),
                "mismatches": sum(not r["identical"] for r in rows),
                "token_sources": {k: sum(st.token_sources()[k] for st in stats) for k in ("lookup", "dspark", "target")}
                if stats else None,
                "per_prompt": rows,
            }
        summary[suite] = per_method
    return summary, mismatches


def pooled_tau(rows: Sequence[dict]) -> float | None:
    """τ over all rounds of a method's runs, ``Σ τ_i · rounds_i / Σ rounds_i`` (as :func:`tau` pools rounds);
    runs without rounds (plain, prompt lookup) are left out, ``None`` if none has any."""
    timed = [(r["tau"], r["rounds"]) for r in rows if r["tau"] is not None and r["rounds"]]
    return sum(t * n for t, n in timed) / sum(n for _, n in timed) if timed else None


def tau_mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def round_costs(records: dict, methods: list[Method]) -> dict:
    """Median draft ms and verify ms per round of every DSpark method in pass 2 (after warm-up)."""
    costs = {}
    for method in methods:
        if method.drafter is None or method.adapter is not None:
            continue
        rounds = [r for prompts in records.values() for p in prompts for r in p["runs"][method.name].stats.rounds]
        costs[method.name] = {
            "rounds": len(rounds),
            "median_draft_ms": median([r.draft_ms for r in rounds]),
            "median_verify_ms": median([r.verify_ms for r in rounds if r.verify_ms > 0]),
            "mean_scheduled": sum(r.scheduled for r in rounds) / len(rounds) if rounds else None,
        }
    return costs


def step_seconds_table(sps, draft_ms: float | None, gamma: int) -> list[float] | None:
    """``[draft + 1 / SPS(ℓ + 1) for ℓ = 0..γ]`` in seconds (``None`` when the curve is too short)."""
    if sps is None or len(sps.steps_per_s) < gamma + 1:
        return None
    return [(draft_ms or 0.0) / 1e3 + 1.0 / sps.steps_per_s[ell] for ell in range(gamma + 1)]


def tau_tables(stats: dict, suites: list[str], gamma: int) -> tuple[dict, dict, dict]:
    """τ per suite and macro, conditional acceptance, and the macro τ ratio dspark / dflash.

    Args:
        stats: ``{"greedy"|"t1": {drafter: {suite: [GenerationStats, ...]}}}`` of fixed-length generations.

    Returns:
        ``(taus, conditional, ratios)``: ``taus[key][drafter][suite|"macro"]``,
        ``conditional[key][suite][drafter]`` (γ values) and ``ratios[key]`` (``None`` without both drafters).
    """
    taus, cond, ratios = {}, {}, {}
    for key, per_drafter in stats.items():
        taus[key], cond[key] = {}, {s: {} for s in suites}
        for name, per_suite in per_drafter.items():
            row = {s: tau([r.accepted for st in per_suite[s] for r in st.rounds]) for s in suites}
            row["macro"] = tau_mean([row[s] for s in suites])
            taus[key][name] = row
            for s in suites:
                cond[key][s][name] = conditional_acceptance(full_rounds(per_suite[s], gamma)[0], gamma)
        a, b = (taus[key].get(n, {}).get("macro") for n in ("dspark", "dflash"))
        ratios[key] = a / b if a and b else None
    return taus, cond, ratios


def confidence_tables(drafters: dict, greedy: dict, suites: list[str], sps, settings: BenchSettings) -> tuple[dict, dict]:
    """Calibration and static threshold sweep per drafter with a confidence head, from greedy fixed rounds.

    Args:
        greedy: ``{drafter: {suite: [GenerationStats, ...]}}`` (see :func:`greedy_rounds`).

    Returns:
        ``(confidence, thresholds)``: per drafter the calibration summary and sweep per suite and ``"all"``,
        and the best threshold by modelled tokens/s (:func:`best_threshold`).
    """
    confidence, thresholds = {}, {}
    for name, drafter in drafters.items():
        if drafter.confidence is None:
            continue
        pooled = sum(greedy[name].values(), [])
        table = step_seconds_table(sps, median([r.draft_ms for st in pooled for r in st.rounds]), settings.gamma)
        entry = {"step_seconds": table, "suites": {}}
        for s in [*suites, "all"]:
            accepted, confs = full_rounds(pooled if s == "all" else greedy[name][s], settings.gamma)
            entry["suites"][s] = {
                "calibration": confidence_summary(confs, accepted, drafter.calibration),
                "threshold_sweep": threshold_sweep(confs, accepted, settings.thresholds, table) if confs else [],
            }
        thresholds[name] = entry["best_threshold"] = best_threshold(entry["suites"]["all"]["threshold_sweep"])
        confidence[name] = entry
    return confidence, thresholds


def builtin_adapters(drafters: dict, gamma: int, enabled: bool) -> tuple[dict, dict]:
    """:class:`BuiltinDFlashAdapter` per parallel drafter, and the ``builtin_dflash`` entry of the result."""
    parallel = [n for n, d in drafters.items() if d.config.sequential_head == "none"]
    if enabled and parallel:
        return ({n: BuiltinDFlashAdapter(drafters[n], gamma) for n in parallel},
                {"status": "adapted", "drafters": parallel, "note": BUILTIN_NOTE})
    return {}, {"status": "not run", "drafters": [],
                "note": "no parallel (sequential_head='none') drafter loaded" if enabled else "disabled"}


def merge_threshold_methods(methods: list[Method], timed: list[Method], wall: dict, more: dict) -> tuple[list, dict]:
    """Pass 3's threshold methods placed right after their drafter's ``fixed`` method, in the list and per suite;
    pass 2's entries win over any of the same name in ``more`` (its ``plain`` above all)."""
    after = {f"{m.drafter}:fixed": m for m in timed}
    ordered = [x for m in methods for x in ([m, after[m.name]] if m.name in after else [m])]
    merged = {}
    for suite, per_method in wall.items():
        both = more[suite] | per_method
        merged[suite] = {m.name: both[m.name] for m in ordered}
    return ordered, merged


def run_bench(target, drafters: dict, suites: dict, settings: BenchSettings, sps=None, notes: list[str] | None = None,
              builtin_dflash: bool = True, command: str = "", log: Callable = _log_default) -> tuple[dict, dict]:
    """Run the whole bench on prompts given as token ids.

    Args:
        target: the causal LM (eval mode).
        drafters: ``{name: DSparkDrafter}``, bound to ``target``, each with a ``calibration``.
        suites: ``{suite: [(prompt_id, ids), ...]}``.
        settings: :class:`BenchSettings`.
        sps: the target's :class:`~dspark_hf.SPSCurve` (default: :func:`~dspark_hf.load_or_profile_sps`);
            it is also the scheduler's curve for every drafter.
        notes: notes gathered while loading, carried into the result.
        builtin_dflash: also time the built-in DFlash path for parallel drafters.
        command: the command line recorded in ``result["machine"]``.

    Returns:
        ``(result, raw)``: the JSON-ready result and the raw records the plots need.
    """
    from ..decoding.kernels import linear_kernels
    from ..decoding.profiling import load_or_profile_sps
    from ..training import data

    notes = list(notes or [])
    start = time.perf_counter()
    # Phase 0: the machine's SPS curve; the scheduler of every drafter uses the same one.
    sps = sps or load_or_profile_sps(target, max_tokens=settings.gamma + 1)  # what the schedulers read
    for drafter in drafters.values():
        drafter.set_sps_curve(sps)

    # Pass 1: fixed-length rounds at T = 1.
    log(f"[bench] pass 1: T = {settings.sampling_temperature} fixed-length rounds (γ={settings.gamma}) of "
        f"{len(drafters)} drafters on {sum(map(len, suites.values()))} prompts")
    sampled = sampled_rounds_pass(target, drafters, suites, settings, log)

    # Pass 2: wall clock, greedy, methods interleaved prompt by prompt; its fixed runs are the greedy τ rounds.
    adapters, builtin = builtin_adapters(drafters, settings.gamma, builtin_dflash)
    methods = plan_methods(drafters, adapters, settings)
    log(f"[bench] pass 2: wall clock of {len(methods)} methods: {', '.join(m.name for m in methods)}")
    records = wall_clock_pass(target, drafters, methods, suites, settings, log)
    stats = {"greedy": greedy_rounds(records, drafters), "t1": sampled}
    taus, cond, ratios = tau_tables(stats, list(suites), settings.gamma)
    if ratios.get("greedy") is None:
        notes.append("tau_ratio_dspark_over_dflash needs drafters named 'dspark' and 'dflash'; not computed.")
    confidence, thresholds = confidence_tables(drafters, stats["greedy"], list(suites), sps, settings)

    # Pass 3: the threshold mode at the best t of the sweep, interleaved with plain once more.
    timed = threshold_methods(thresholds, settings)
    notes += [f"{n}: the best static threshold is t = 0, which keeps every draft: `{n}:threshold` is `{n}:fixed` "
              "and is not timed twice." for n, t in thresholds.items() if t == 0]
    wall, mismatches = summarize_wall_clock(records, methods, log)
    costs = round_costs(records, methods)
    if timed:
        log(f"[bench] pass 3: wall clock of {', '.join(m.name for m in timed)} at the best threshold, against plain")
        extra = wall_clock_pass(target, drafters, [Method("plain"), *timed], suites, settings, log)
        more, more_mismatches = summarize_wall_clock(extra, timed, log)
        methods, wall = merge_threshold_methods(methods, timed, wall, more)
        mismatches += more_mismatches
        costs.update(round_costs(extra, timed))
        notes.append("Threshold-mode speedups are measured against a plain run interleaved with them in pass 3.")
    log(f"[bench] greedy mismatches against plain generate: {len(mismatches)}")

    result = {
        "schema_version": SCHEMA_VERSION,
        "machine": {**machine_info(command), "linear_kernels": linear_kernels(target)},
        "settings": {**asdict(settings), "thresholds": list(settings.thresholds),
                     "math_filter": {"keywords_or_arithmetic": data.MATH_PATTERN.pattern, "excluded": data.NOT_MATH_PATTERN.pattern,
                                     "max_chars": data.MATH_MAX_CHARS}},
        "suites": {s: {"n_prompts": len(p), "ids": [i for i, _ in p], "prompt_tokens": [len(x) for _, x in p]}
                   for s, p in suites.items()},
        "drafters": {n: describe_drafter(d) for n, d in drafters.items()},
        "tau_ratio_dspark_over_dflash": ratios.get("greedy"),
        "tau_ratios": ratios,
        "tau": taus,
        "conditional_acceptance": cond,
        "confidence": confidence,
        "wall_clock": {"methods": [m.name for m in methods],
                       "thresholds": {n: t for n, t in thresholds.items()},
                       "suites": wall,
                       "mismatches_total": len(mismatches),
                       "mismatches": mismatches},
        "builtin_dflash": builtin,
        "sps": {"steps_per_s": sps.steps_per_s, "ms_per_step": [1e3 / s for s in sps.steps_per_s],
                "device_name": sps.device_name, "context_len": sps.context_len, "target_name": sps.target_name},
        "round_cost": costs,
        "notes": notes,
        "runtime_s": time.perf_counter() - start,
    }
    return _json_safe(result), {"stats": stats, "records": records}


BUILTIN_NOTE = (
    "transformers' DFlashTokenCandidateGenerator runs unchanged through BuiltinDFlashAdapter: the adapter "
    "implements forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache) with "
    "block_size = γ + 1 (the built-in path reads slots 1.., ours predicts from slot 0). SmolLM2 has no mask "
    "token: mask_token_id = 0 is a placeholder and the mask slots use the drafter's learned mask embedding. "
    "The built-in path applies the target's full lm_head, so a restricted draft vocabulary is not enforced "
    "(drafts can differ from the drafter's own 'fixed' path)."
)


def describe_drafter(drafter) -> dict:
    cfg = drafter.config
    return {
        "path": getattr(drafter, "bench_path", None),
        "sequential_head": cfg.sequential_head,
        "confidence_head": drafter.confidence is not None,
        "block_size": cfg.block_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "draft_vocab_size": cfg.draft_vocab_size,
        "calibration": getattr(drafter, "bench_calibration", "calibration.json"),
        "modes": modes_of(drafter),
    }


# ------------------------------------------------------------------------------------------ loading
def parse_drafters(spec: str) -> dict[str, str]:
    """``"a=PATH,b=PATH"`` -> ``{"a": "PATH", "b": "PATH"}``.

    Raises:
        ValueError: an entry without ``=`` or a repeated name.
    """
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--drafters entries are name=PATH, got {item!r}")
        if name in out:
            raise ValueError(f"drafter name {name!r} given twice")
        out[name] = path
    return out


def load_drafters(spec: dict[str, str], target, gamma: int, log=_log_default) -> tuple[dict, list[str]]:
    """Load every drafter folder that exists (relative paths: CWD first, then the repo root), bind it.

    A drafter with a confidence head but no ``calibration.json`` gets identity STS (all T = 1), and a note.

    Returns:
        ``({name: drafter}, notes)``.

    Raises:
        ValueError: a calibration that covers fewer than γ positions.
    """
    from ..decoding.calibration import SequentialTemperatureScaling
    from ..modeling.modeling_dspark import DSparkDrafter

    drafters, notes = {}, []
    for name, path in spec.items():
        folder = resolve_checkout_path(path)
        if not folder.is_dir():
            note = f"drafter {name!r}: no folder at {path}; skipped."
            log(f"note: {note}")
            notes.append(note)
            continue
        drafter = DSparkDrafter.from_pretrained(str(folder)).bind(target).eval()
        drafter.bench_path = str(folder)
        drafter.bench_calibration = "calibration.json"
        if drafter.confidence is not None and drafter.calibration is None:
            drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * max(gamma, drafter.config.block_size))
            drafter.bench_calibration = "identity (no calibration.json)"
            note = (f"drafter {name!r} has no calibration.json: STS is the identity (all T = 1), so 'after STS' "
                    "equals 'before' and the scheduler uses raw confidences.")
            log(f"note: {note}")
            notes.append(note)
        if drafter.calibration is not None and len(drafter.calibration.temperatures) < gamma:
            raise ValueError(f"drafter {name!r}: calibration covers {len(drafter.calibration.temperatures)} positions, "
                             f"γ = {gamma}; pass --gamma {len(drafter.calibration.temperatures)} or recalibrate.")
        if drafter.config.block_size != gamma:
            notes.append(f"drafter {name!r} was trained with block_size {drafter.config.block_size}; benched at γ = {gamma}.")
        drafters[name] = drafter
    return drafters, notes


def machine_info(command: str) -> dict:
    """CPU model, cores, threads, versions, date and the exact command line."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


# ------------------------------------------------------------------------------------------ report
def _fmt(value, digits=2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) if not isinstance(v, str) else v for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _sources(counts: dict | None) -> str:
    """``"lookup / dspark / target"`` shares of a method's tokens in percent (``–`` for methods without rounds)."""
    total = sum(counts.values()) if counts else 0
    if not total:
        return "–"
    return " / ".join(f"{100 * counts[k] / total:.0f}%" for k in ("lookup", "dspark", "target"))


def markdown_report(result: dict) -> str:
    """The tables of ``benchmarks.md``."""
    m, s = result["machine"], result["settings"]
    suites = list(result["suites"])
    out = [
        "# dspark bench",
        "",
        f"`{m['command']}`  ",
        f"{m['date']} · {m['cpu']} · {m['cores']} cores ({m['torch_threads']} torch threads) · torch {m['torch']} · "
        f"transformers {m['transformers']} · linear kernels: {m.get('linear_kernels', 'stock')} · "
        f"runtime {result['runtime_s'] / 60:.1f} min",
        "",
        f"γ = {s['gamma']}, {s['max_new_tokens']} new tokens, up to {s['limit']} prompts per suite "
        f"(≤ {s['max_prompt_tokens']} prompt tokens): "
        + ", ".join(f"{n} {v['n_prompts']}" for n, v in result["suites"].items()) + ".",
        "",
    ]
    if result["notes"]:
        out += ["**Notes**", ""] + [f"- {n}" for n in result["notes"]] + [""]
    out += ["## τ (accepted length per round, bonus included; fixed-length verification)", ""]
    for key, label in (("greedy", "greedy"), ("t1", f"T = {s['sampling_temperature']}")):
        rows = [[name, *(row[x] for x in suites), row["macro"]] for name, row in result["tau"][key].items()]
        out += [f"**{label}**", "", _table(["drafter", *suites, "macro"], rows), ""]
    ratios = result["tau_ratios"]
    out += [f"macro τ(dspark) / macro τ(dflash): greedy {_fmt(ratios.get('greedy'), 3)}, "
            f"T = 1 {_fmt(ratios.get('t1'), 3)}", ""]

    out += ["## Position-wise conditional acceptance P(n ≥ k | n ≥ k−1)", "",
            "Fixed rounds that verified all γ drafts (the last round of each generation dropped); – where no "
            "round reached position k−1.", ""]
    for suite in suites:
        rows = [[f"{name} ({key})", *vals] for key in ("greedy", "t1")
                for name, vals in result["conditional_acceptance"][key][suite].items()]
        out += [f"**{suite}**", "", _table(["drafter", *(f"k={k}" for k in range(1, s["gamma"] + 1))], rows), ""]

    out += ["## Confidence (greedy fixed rounds)", "",
            "ECE of the prefix survival probability a_k = c_1···c_k against 1[n ≥ k] over all rounds (every round "
            "has a label at every position; deep positions, with a_k and the survival rate near 0, have a small "
            "ECE); ROC-AUC of c_k on the rounds that reached k (n ≥ k−1), – where one class is absent.", ""]
    for name, entry in result["confidence"].items():
        cal = entry["suites"]["all"]["calibration"]
        if cal is None:
            out += [f"**{name}**: no full rounds.", ""]
            continue
        out += [f"**{name}** ({cal['rounds']} rounds, all suites): mean ECE of a_k {100 * cal['mean_ece_before']:.1f}% "
                f"before STS → {100 * cal['mean_ece_after']:.1f}% after; best static threshold by modelled "
                f"tokens/s (SPS curve + median draft cost): t = {_fmt(entry['best_threshold'], 1)}", ""]
        rows = [[p["position"], p["survival_rate"], 100 * p["ece_before"], 100 * p["ece_after"], p["roc_auc"],
                 p["n_conditional"]] for p in cal["positions"]]
        out += [_table(["k", "survival", "ECE before %", "ECE after %", "ROC-AUC", "n (n ≥ k−1)"], rows), ""]
        panels = [x for x in [*suites, "all"] if entry["suites"][x]["threshold_sweep"]]
        if panels:
            sweeps = [entry["suites"][x]["threshold_sweep"] for x in panels]
            rows = [[_fmt(sweeps[0][i]["threshold"], 1),
                     *(f"{_fmt(sw[i]['accepted_per_step'])} / {_fmt(sw[i]['rejected_per_step'])} / "
                       f"{_fmt(100 * sw[i]['acceptance_rate'], 1)}%" for sw in sweeps),
                     sweeps[-1][i].get("modelled_tokens_per_s")] for i in range(len(sweeps[0]))]
            out += ["Static threshold sweep (accepted incl. bonus / rejected per step / acceptance rate):", "",
                    _table(["t", *panels, "modelled tok/s (all)"], rows), ""]

    wall = result["wall_clock"]
    out += ["## Wall clock (greedy; methods interleaved per prompt)", "",
            f"Greedy outputs differing from plain `generate`: **{wall['mismatches_total']}**", ""]
    for suite, per_method in wall["suites"].items():
        rows = [[name, v["median_tokens_per_s"], v["median_speedup"], v["speedup_of_medians"], v["tau"],
                 _sources(v.get("token_sources")), v["mismatches"]] for name, v in per_method.items()]
        out += [f"**{suite}**", "", _table(["method", "median tok/s", "median per-prompt speedup", "speedup of medians",
                                            "τ", "tokens from lookup / DSpark / target", "mismatches"], rows), ""]
    b = result["builtin_dflash"]
    out += [f"Built-in `speculation_type=\"dflash\"`: {b['status']}. {b['note']}", ""]

    out += ["## Cost per round and SPS curve", ""]
    rows = [[name, v["rounds"], v["median_draft_ms"], v["median_verify_ms"], v["mean_scheduled"]]
            for name, v in result["round_cost"].items()]
    out += [_table(["method", "rounds", "median draft ms", "median verify ms", "mean ℓ"], rows), ""]
    sps = result["sps"]
    shown = [b for b in (1, 2, 4, 8, 16, 32) if b <= len(sps["ms_per_step"])]
    out += [f"SPS curve ({sps['device_name']}, context {sps['context_len']}), ms per verification step:", "",
            _table(["B", *map(str, shown)], [["ms", *(sps["ms_per_step"][b - 1] for b in shown)]]), ""]
    if result.get("plots"):
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in result["plots"]] + [""]
    return "\n".join(out)


def _figure(ncols=1, nrows=1, width=4.0, height=3.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def write_plots(result: dict, raw: dict, out_dir: Path, drafters: dict) -> list[str]:
    """Conditional acceptance per suite, threshold sweep per drafter, SPS curve, reliability, speedups."""
    from ..decoding.calibration import reliability_diagram

    written, gamma = [], result["settings"]["gamma"]
    positions = list(range(1, gamma + 1))
    for suite in result["suites"]:  # paper Fig. 2
        fig = _figure()
        ax = fig.add_subplot()
        for i, name in enumerate(result["drafters"]):
            for key, style in (("t1", "-"), ("greedy", "--")):
                vals = result["conditional_acceptance"][key][suite][name]
                ys = [float("nan") if v is None else v for v in vals]
                ax.plot(positions, ys, style, marker="o", markersize=3, color=f"C{i}", label=f"{name} ({key})")
        ax.set(title=f"{suite}: conditional acceptance", xlabel="draft position k", ylabel="P(n ≥ k | n ≥ k−1)",
               xticks=positions)
        ax.legend(fontsize="x-small")
        written.append(_save(fig, out_dir / f"conditional_acceptance_{suite}.png"))
    for name, entry in result["confidence"].items():  # paper Fig. 5
        panels = [s for s in [*result["suites"], "all"] if entry["suites"][s]["threshold_sweep"]]
        if not panels:
            continue
        fig = _figure(ncols=len(panels))
        for i, suite in enumerate(panels):
            sweep = entry["suites"][suite]["threshold_sweep"]
            ts = [r["threshold"] for r in sweep]
            acc, rej = [r["accepted_per_step"] for r in sweep], [r["rejected_per_step"] for r in sweep]
            ax = fig.add_subplot(1, len(panels), i + 1)
            ax.bar(ts, acc, width=0.08, color="C0", label="accepted tokens")
            ax.bar(ts, rej, width=0.08, bottom=acc, color="C3", hatch="//", alpha=0.6, label="rejected tokens")
            ax.set(title=f"{name}: {suite}", xlabel="confidence threshold", ylabel="avg. tokens per step")
            twin = ax.twinx()
            twin.plot(ts, [100 * r["acceptance_rate"] for r in sweep], color="k", marker="o", markersize=3,
                      label="acceptance rate")
            twin.set(ylim=(0, 105), ylabel="acceptance rate %")
            if i == 0:
                ax.legend(fontsize="x-small", loc="upper right")
        written.append(_save(fig, out_dir / f"threshold_sweep_{name}.png"))
        drafter = drafters.get(name)
        accepted, confs = full_rounds(sum(raw["stats"]["greedy"][name].values(), []), gamma)
        if drafter is not None and confs:
            written.append(str(reliability_diagram(torch.tensor(confs, dtype=torch.float64), torch.tensor(accepted),
                                                   drafter.calibration, out_dir / f"reliability_{name}.png")))
    fig = _figure()
    ax = fig.add_subplot()
    ms = result["sps"]["ms_per_step"]
    ax.plot(range(1, len(ms) + 1), ms, marker="o", markersize=3)
    ax.set(title="target verification cost", xlabel="tokens verified B", ylabel="ms per step", ylim=(0, None))
    written.append(_save(fig, out_dir / "sps_curve.png"))
    suites, methods = list(result["wall_clock"]["suites"]), result["wall_clock"]["methods"]
    fig = _figure(width=max(5.0, 0.6 * len(methods) * len(suites)))
    ax = fig.add_subplot()
    width = 0.8 / max(len(suites), 1)
    for i, suite in enumerate(suites):
        vals = [result["wall_clock"]["suites"][suite][m]["median_speedup"] or 0 for m in methods]
        ax.bar([j + i * width for j in range(len(methods))], vals, width=width, label=suite)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(methods))], methods, rotation=30, ha="right", fontsize="small")
    ax.set(ylabel="median per-prompt speedup", title="greedy wall clock vs plain generate")
    ax.legend(fontsize="x-small")
    written.append(_save(fig, out_dir / "wall_clock_speedup.png"))
    return [Path(p).name for p in written]


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return str(path)


def write_report(result: dict, raw: dict, out_dir: str | os.PathLike, drafters: dict) -> Path:
    """Write ``benchmarks.json``, ``benchmarks.md`` and the PNGs into ``out_dir``; returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = write_plots(result, raw, out, drafters)
    (out / "benchmarks.md").write_text(markdown_report(result) + "\n")
    path = out / "benchmarks.json"
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    return path


def _json_safe(value):
    """NaN/inf -> None, recursively (the JSON must stay strict)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
