"""The methods ``dspark bench`` times: plain ``generate``, prompt lookup, the built-in DFlash path (through
:class:`BuiltinDFlashAdapter`), each drafter's verification modes and its hybrid with prompt lookup."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field, fields, replace

import torch

from ..decoding.candidate_generator import floor_rounds
from ..decoding.lookup import lookup_missing
from ..decoding.verification import POLICIES, runnable_modes
from ..evaluation.runs import Run
from .loading import DrafterSource
from .settings import BenchSettings


class BuiltinDFlashAdapter(torch.nn.Module):
    """A parallel DSpark drafter (``sequential_head="none"``) behind transformers' built-in DFlash interface.

    ``target.generate(..., assistant_model=adapter, speculation_type="dflash")`` runs transformers' own
    ``DFlashTokenCandidateGenerator``: it feeds ``[anchor, mask x (block_size - 1)]`` embeddings plus the
    target features of the newly accepted positions and drafts ``argmax lm_head(last_hidden_state[:, 1:])``.
    Our drafter predicts draft k from block slot k - 1 (the anchor is prediction slot 1), so the adapter
    declares ``block_size = γ + 1`` and returns ``[h_1, h_1, ..., h_γ]`` (slot 0 is never read). What differs
    from the drafter's own path, by construction of the built-in one:

    * the mask slots use the drafter's :meth:`~dspark_hf.modeling.modeling_dspark.DSparkDrafter.mask_vector` (v2: the target's
      embedding of ``mask_token_id``, as the built-in path; v1: the learned mask embedding, with
      ``mask_token_id = 0`` a placeholder the adapter never reads);
    * logits come from the target's FULL lm_head, so a restricted draft vocabulary is not enforced;
    * the context K/V live in the drafter's own :class:`~dspark_hf.modeling.outputs.DraftContext` (reset whenever the
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


@dataclass
class BuiltinRun(Run):
    """A :class:`~dspark_hf.evaluation.runs.Run` of the built-in DFlash path, which records no round statistics.

    Attributes:
        builtin_rounds: the adapter's forward calls (drafted blocks) in the run; the prefill token is not a round.
    """

    builtin_rounds: int = 0


def rounds_of(run: Run) -> int | None:
    """Rounds of a speculative run (its statistics, or a :class:`BuiltinRun`'s drafted blocks); ``None`` for plain
    decoding and prompt lookup."""
    if run.stats is not None:
        return len(run.stats.rounds)
    return run.builtin_rounds if isinstance(run, BuiltinRun) else None


@dataclass
class Method:
    """One timed greedy decoding method of pass 2.

    Attributes:
        name: ``plain``, ``prompt-lookup``, ``<drafter>:<mode>`` or ``<drafter>:builtin-dflash``.
        drafter: the DSpark drafter's name, or ``None``.
        kwargs: extra ``generate`` keyword arguments.
        adapter: the :class:`BuiltinDFlashAdapter` of a built-in DFlash method.
        floor: run with drafting forced off (:func:`~dspark_hf.decoding.candidate_generator.floor_rounds`: every
            round verifies the target's token alone), for the floor pass.
    """

    name: str
    drafter: str | None = None
    kwargs: dict = field(default_factory=dict)
    adapter: BuiltinDFlashAdapter | None = None
    floor: bool = False

    def run(self, target, ids, max_new_tokens, drafters, seed=0) -> Run:
        """One timed greedy ``generate`` of ``ids`` (a :class:`BuiltinRun` for the built-in DFlash path)."""
        from ..evaluation.runs import timed_generate

        drafter = drafters[self.drafter] if self.drafter and self.adapter is None else None
        with floor_rounds() if self.floor else contextlib.nullcontext():
            run = timed_generate(target, ids, max_new_tokens, 0.0, drafter, seed=seed, **self.kwargs)
        if self.adapter is None:
            return run
        return BuiltinRun(**{f.name: getattr(run, f.name) for f in fields(run)}, builtin_rounds=self.adapter.rounds)


BENCH_MODE_ORDER = ("fixed", "threshold", "scheduler", "async")  # the order of the tables and of benchmarks.json


def modes_of(drafter) -> list[str]:
    """Verification modes a drafter can run (:func:`~dspark_hf.decoding.verification.runnable_modes`): fixed
    always; the others need the confidence head (and the scheduled ones a calibration, which
    :func:`~dspark_hf.bench.loading.load_drafters` always attaches)."""
    return runnable_modes(drafter, order=BENCH_MODE_ORDER)


def lookup_mode_of(drafter, gamma: int) -> str | None:
    """Verification mode of a drafter's hybrid method (``dspark_lookup=True``, :mod:`dspark_hf.decoding.lookup`): its
    config's mode when that is a scheduled one, else ``"async"``; ``None`` without calibrated confidences for γ."""
    if lookup_missing(drafter, gamma) is not None:
        return None
    return drafter.config.verification if POLICIES[drafter.config.verification].needs_calibration else "async"


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
                methods.append(Method(f"{name}:{mode}", name, {  # DSpark alone: lookup pinned off
                    "dspark_verification": mode, "dspark_block_size": settings.gamma, "dspark_lookup": False}))
        mode = lookup_mode_of(drafter, settings.gamma)
        if mode is not None:
            methods.append(Method(f"{name}:{mode}+lookup", name, {
                "dspark_verification": mode, "dspark_block_size": settings.gamma, "dspark_lookup": True}))
    return methods


def floor_methods(methods: list[Method]) -> list[Method]:
    """The floor pass's arms (issue #28): each drafter's default method, its hybrid with prompt lookup
    (``<drafter>:<mode>+lookup``, :func:`lookup_mode_of`), run with drafting forced off (``floor=True``)."""
    return [replace(m, floor=True) for m in methods if m.drafter is not None and m.kwargs.get("dspark_lookup")]


def threshold_methods(thresholds: dict, settings: BenchSettings) -> list[Method]:
    """Pass-3 methods: each drafter's ``threshold`` mode at its best t > 0.

    t = 0 keeps every draft, which is the ``fixed`` mode already timed in pass 2, and ``None`` (no modelled
    sweep) has nothing to run: both are left out.
    """
    return [Method(f"{name}:threshold", name, {"dspark_verification": "threshold", "dspark_block_size": settings.gamma,
                                               "dspark_threshold": t, "dspark_lookup": False})
            for name, t in thresholds.items() if t]


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


BUILTIN_NOTE = (
    "transformers' DFlashTokenCandidateGenerator runs unchanged through BuiltinDFlashAdapter: the adapter "
    "implements forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache) with "
    "block_size = γ + 1 (the built-in path reads slots 1.., ours predicts from slot 0). SmolLM2 has no mask "
    "token: mask_token_id = 0 is a placeholder and the mask slots use the drafter's learned mask embedding. "
    "The built-in path applies the target's full lm_head, so a restricted draft vocabulary is not enforced "
    "(drafts can differ from the drafter's own 'fixed' path)."
)


def describe_drafter(drafter, source: DrafterSource) -> dict:
    """The ``drafters[name]`` entry of ``benchmarks.json``: where the drafter came from and what it can run."""
    cfg = drafter.config
    return {
        "path": source.path,
        "sequential_head": cfg.sequential_head,
        "confidence_head": drafter.confidence is not None,
        "block_size": cfg.block_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "draft_vocab_size": cfg.draft_vocab_size,
        "calibration": source.calibration,
        "modes": modes_of(drafter),
    }


def interleaved_runs(target, ids, methods: list[Method], repeats: int, max_new_tokens: int, drafters,
                     counter: int) -> tuple[dict[str, list[Run]], int]:
    """Every method on one prompt ``repeats`` times, interleaved: each repeat runs them all, its order rotated by one
    more than the last (``counter`` carries the rotation across prompts, so no method always runs first).

    Returns:
        ``({method name: [Run, ...]}, counter)``: the runs in the order they ran, and the rotation to pass on.
    """
    runs = {m.name: [] for m in methods}
    for _ in range(repeats):
        shift, counter = counter % len(methods), counter + 1
        for method in methods[shift:] + methods[:shift]:
            runs[method.name].append(method.run(target, ids, max_new_tokens, drafters))
    return runs, counter


def lockstep_runs(target, ids, methods: list[Method], repeats: int, max_new_tokens: int, drafters,
                  counter: int) -> tuple[dict[str, list[Run]], dict[str, list[Run]], int]:
    """Every method but plain (``methods[0]``) on one prompt ``repeats`` times, each run in lockstep with a plain
    ``generate`` of the same prompt (:func:`~dspark_hf.bench.lockstep.run_lockstep`: one target forward of each in
    turn, each timed on its own turns, so the machine's drift hits both); each repeat takes the methods in an order
    rotated by one more than the last, and plain takes the first turn in every other repeat (``counter`` carries
    both across prompts, as in :func:`interleaved_runs`).

    Returns:
        ``({method name: [Run, ...]}, {method name: [its plain partners' Runs]}, counter)``, runs in the order they
        ran; ``"plain"`` holds every plain run.

    Raises:
        ValueError: ``methods[0]`` is not plain ``generate``.
    """
    from .lockstep import run_lockstep

    plain, others = methods[0], methods[1:]
    if plain.name != "plain":
        raise ValueError(f"lockstep pairs every method with plain generate, methods[0]; got {plain.name!r}.")
    runs, partners = {m.name: [] for m in methods}, {m.name: [] for m in others}
    for _ in range(repeats):
        first, shift, counter = counter % 2, counter % max(len(others), 1), counter + 1
        for method in others[shift:] + others[:shift]:
            pair = [lambda: plain.run(target, ids, max_new_tokens, drafters),
                    lambda m=method: m.run(target, ids, max_new_tokens, drafters)]
            together = run_lockstep(target, pair, first=first).values
            runs[plain.name].append(together[0])
            partners[method.name].append(together[0])
            runs[method.name].append(together[1])
    return runs, partners, counter
