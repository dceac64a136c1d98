"""The typed result of ``dspark bench``: the one schema of ``benchmarks.json`` (``schema_version`` 1).

The runner (:func:`dspark_hf.bench.runner.run_bench`) produces a :class:`BenchResult`; the report (Markdown, PNG),
``dspark card`` (:mod:`dspark_hf.hub.sections`) and ``dspark bench --json`` read it. It lives here, below ``bench``
and ``hub``, so both can import it.

JSON keys are the field names, in field order; every class is a :class:`~dspark_hf.evaluation.records.Record`,
which loads leniently and writes back exactly what it loaded, so older and partial files load and
``docs/benchmarks.json`` round-trips byte for byte.

Names used below: a *suite* is a prompt source (``code``, ``chat``, ``math``, ``custom``); a *drafter* is a name
given to ``--drafters``; a *method* is a timed way of generating (``plain``, ``prompt-lookup``,
``<drafter>:<mode>``, ``<drafter>:<mode>+lookup``, ``<drafter>:builtin-dflash``); a *setting* is ``greedy`` or
``t1`` (sampling at ``settings.sampling_temperature``). τ counts the bonus token.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .records import Record

SCHEMA_VERSION = 1

__all__ = [
    "SCHEMA_VERSION", "BenchResult", "BuiltinDFlash", "CalibrationSummary", "DrafterConfidence", "DrafterRecord",
    "FloorCost", "MachineRecord", "MathFilter", "MethodSummary", "Mismatch", "PositionCalibration", "PromptRun", "Record",
    "RoundCost", "RunSettings", "SPSRecord", "SuiteConfidence", "SuiteRecord", "SweepPoint", "WallClock",
    "as_bench_result",
]


# ------------------------------------------------------------------------------------------- the run
@dataclass
class MachineRecord(Record):
    """Where the run was measured: :class:`~dspark_hf.runtime.machine.Machine` plus when, how and which kernels.

    Attributes:
        cpu: CPU model; cores: logical CPUs; torch_threads: torch's intra-op threads; cuda: GPU name or ``None``;
        torch, transformers, python: versions; platform: ``platform.platform()``.
        date: UTC start of the run, ISO 8601 (seconds). command: the exact command line.
        linear_kernels: the target's linear kernels (``"stock"`` or e.g. ``"onednn-prepacked"``).
        isa: the CPU's vector instruction set (the ``isa`` of :func:`~dspark_hf.runtime.machine.describe_machine`, e.g. ``"AVX2"``;
            ``""`` in records written before it was recorded).
    """

    cpu: str
    cores: int | None
    torch_threads: int
    cuda: str | None
    torch: str
    transformers: str
    python: str
    platform: str
    date: str
    command: str
    linear_kernels: str = "stock"
    isa: str = ""

    @classmethod
    def current(cls, command: str, linear_kernels: str = "stock", date: str | None = None) -> MachineRecord:
        """This machine (:func:`~dspark_hf.runtime.machine.describe_machine`), now (UTC) unless ``date`` is given."""
        from datetime import datetime, timezone

        from ..runtime.machine import describe_machine

        m = describe_machine()
        return cls(cpu=m.cpu, cores=m.cores, torch_threads=m.torch_threads, cuda=m.cuda, torch=m.torch,
                   transformers=m.transformers, python=m.python, platform=m.platform,
                   date=date or datetime.now(timezone.utc).isoformat(timespec="seconds"), command=command,
                   linear_kernels=linear_kernels, isa=m.isa)


@dataclass
class MathFilter(Record):
    """What made a ShareGPT prompt a ``math`` one: ``keywords_or_arithmetic`` and ``excluded`` (regular
    expressions) and ``max_chars`` (longest prompt, characters); see :func:`dspark_hf.sources.categories.is_math_problem`."""

    keywords_or_arithmetic: str
    excluded: str
    max_chars: int


@dataclass
class RunSettings(Record):
    """The :class:`~dspark_hf.bench.settings.BenchSettings` of the run (same fields, same order) and the math filter.

    Attributes:
        gamma: drafts per round γ. max_new_tokens: new tokens per generation. limit: prompts per suite at most.
        max_prompt_tokens: longer chat-formatted prompts were skipped. thresholds: static thresholds of the sweep.
        sampling_temperature: temperature of the ``t1`` τ pass. prompt_lookup_num_tokens: of the prompt-lookup
        baseline. warmup_tokens: length of the untimed warm-up generation per method. repeats: wall-clock runs per
        method and prompt (absent in older files: 1). lockstep: passes 2 and 3 ran each method in lockstep with plain
        (``--lockstep``; absent in older files: no). floor_repeats: runs per prompt of the floor pass (absent in
        older files). math_filter: :class:`MathFilter`.
    """

    gamma: int
    max_new_tokens: int
    limit: int
    max_prompt_tokens: int
    thresholds: list[float]
    sampling_temperature: float
    prompt_lookup_num_tokens: int
    warmup_tokens: int
    repeats: int | None = field(default=None, metadata={"omit_none": True})
    lockstep: bool | None = field(default=None, metadata={"omit_none": True})
    floor_repeats: int | None = field(default=None, metadata={"omit_none": True})
    math_filter: MathFilter | None = None


@dataclass
class SuiteRecord(Record):
    """The prompts of one suite: ``n_prompts``, their ``ids`` and ``prompt_tokens`` (chat-formatted lengths)."""

    n_prompts: int
    ids: list[str]
    prompt_tokens: list[int]


@dataclass
class DrafterRecord(Record):
    """One benched drafter: its folder (``path``), ``sequential_head`` (``none``/``markov``/``rnn``),
    ``confidence_head``, trained ``block_size``, ``num_hidden_layers``, ``draft_vocab_size`` (``None``: the target's),
    ``calibration`` (the file, or a note when STS is the identity) and the verification ``modes`` benched."""

    path: str | None
    sequential_head: str
    confidence_head: bool
    block_size: int
    num_hidden_layers: int
    draft_vocab_size: int | None
    calibration: str
    modes: list[str]


# ------------------------------------------------------------------------------------------- confidence
@dataclass
class PositionCalibration(Record):
    """Draft position k (``position``, 1-based) over full greedy rounds: the STS ``temperature`` T_k,
    ``survival_rate`` (share of rounds with n ≥ k), ECE of a_k ``ece_before`` / ``ece_after`` STS (fractions),
    ``roc_auc`` of c_k on rounds that reached k (``None`` when one class is absent) and their count ``n_conditional``."""

    position: int
    temperature: float
    survival_rate: float
    ece_before: float
    ece_after: float
    roc_auc: float | None
    n_conditional: int


@dataclass
class CalibrationSummary(Record):
    """Calibration over ``rounds`` full rounds: mean ECE of a_k before / after STS (fractions) and per position."""

    rounds: int
    mean_ece_before: float
    mean_ece_after: float
    positions: list[PositionCalibration]


@dataclass
class SweepPoint(Record):
    """Static threshold ``threshold`` replayed on ``rounds`` fixed rounds (paper Fig. 5), per verification step:
    ``accepted_per_step`` (bonus included, = τ), ``rejected_per_step``, ``verified_per_step`` (mean ℓ);
    ``acceptance_rate`` (bonus included) and ``draft_acceptance_rate`` (drafts only; ``None`` if nothing verified);
    ``modelled_tokens_per_s`` from the SPS curve and the median draft cost (absent without a curve)."""

    threshold: float
    rounds: int
    accepted_per_step: float | None
    rejected_per_step: float | None
    verified_per_step: float | None
    acceptance_rate: float | None
    draft_acceptance_rate: float | None
    modelled_tokens_per_s: float | None = None


@dataclass
class SuiteConfidence(Record):
    """One suite (or ``all``) of a drafter: ``calibration`` (``None`` without full rounds) and ``threshold_sweep``."""

    calibration: CalibrationSummary | None
    threshold_sweep: list[SweepPoint] = field(default_factory=list)


@dataclass
class DrafterConfidence(Record):
    """A drafter with a confidence head: ``step_seconds[ℓ]`` (modelled seconds of a round verifying ℓ drafts,
    ℓ = 0..γ; ``None`` when the SPS curve is too short), per suite and ``all`` a :class:`SuiteConfidence`, and the
    ``best_threshold`` by modelled tokens/s (``None`` if unmodelled)."""

    step_seconds: list[float] | None
    suites: dict[str, SuiteConfidence]
    best_threshold: float | None


# ------------------------------------------------------------------------------------------- wall clock
@dataclass
class PromptRun(Record):
    """One method on one prompt (greedy): prompt ``id``, ``new_tokens``, ``seconds`` (wall), ``tokens_per_s``,
    ``speedup`` over plain on the same prompt, ``tau`` and ``rounds`` (``None`` for methods without rounds),
    whether the output is ``identical`` to plain ``generate``'s (in every run) and, with ``--repeats`` > 1,
    ``speedup_runs``: each run's speedup over plain's run of the same repeat (the reported figures are of each
    method's median run)."""

    id: str
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float
    tau: float | None
    rounds: int | None
    identical: bool
    speedup_runs: list[float] | None = field(default=None, metadata={"omit_none": True})


@dataclass
class MethodSummary(Record):
    """One method on one suite: ``median_tokens_per_s``, ``median_speedup`` (median of per-prompt ratios),
    ``speedup_of_medians`` (its median tok/s over plain's), ``tau`` pooled over rounds (``None`` without rounds),
    ``mismatches`` against plain greedy output, ``min_speedup`` (the worst prompt's speedup; absent in older
    files), ``token_sources`` (``{"lookup", "dspark", "target"}`` token counts,
    ``None`` for methods without DSpark rounds; absent in files before it was recorded) and ``per_prompt`` rows."""

    median_tokens_per_s: float | None
    median_speedup: float | None
    speedup_of_medians: float | None
    tau: float | None
    mismatches: int
    min_speedup: float | None = field(default=None, metadata={"omit_none": True})
    token_sources: dict[str, int] | None = None
    per_prompt: list[PromptRun] = field(default_factory=list)


@dataclass
class Mismatch(Record):
    """A greedy output that differs from plain ``generate``'s: where (``suite``, ``prompt``, ``method``), the first
    differing new token (``position``) and both lengths (``tokens``, ``plain_tokens``)."""

    suite: str
    prompt: str
    method: str
    position: int
    tokens: int
    plain_tokens: int


@dataclass
class WallClock(Record):
    """Greedy wall clock: the timed ``methods`` in table order, the ``thresholds`` the threshold mode ran at
    (per drafter), ``suites[suite][method]`` a :class:`MethodSummary`, and the greedy mismatches."""

    methods: list[str]
    thresholds: dict[str, float | None]
    suites: dict[str, dict[str, MethodSummary]]
    mismatches_total: int
    mismatches: list[Mismatch] = field(default_factory=list)


@dataclass
class BuiltinDFlash(Record):
    """transformers' own ``speculation_type="dflash"`` path: ``status`` (``"adapted"`` or ``"not run"``), the
    parallel ``drafters`` it ran with and a ``note``."""

    status: str
    drafters: list[str]
    note: str


@dataclass
class SPSRecord(Record):
    """The target's SPS curve: ``steps_per_s[B - 1]`` and ``ms_per_step[B - 1]`` for verifying B tokens at once,
    on ``device_name`` with ``context_len`` tokens of context, for ``target_name``; ``ms_per_step_by_context``:
    ``{context length: ms_per_step}`` for every row of the curve (the primary one included)."""

    steps_per_s: list[float]
    ms_per_step: list[float]
    device_name: str
    context_len: int
    target_name: str
    ms_per_step_by_context: dict[str, list[float]] | None = field(default=None, metadata={"omit_none": True})

    @classmethod
    def from_curve(cls, sps) -> SPSRecord:
        """From a :class:`~dspark_hf.runtime.sps.SPSCurve`."""
        return cls(steps_per_s=list(sps.steps_per_s), ms_per_step=[1e3 / s for s in sps.steps_per_s],
                   device_name=sps.device_name, context_len=sps.context_len, target_name=sps.target_name,
                   ms_per_step_by_context={str(k): [1e3 / s for s in row] for k, row in sps.rows.items()})


@dataclass
class RoundCost(Record):
    """Cost per round of a DSpark method over its timed runs: ``rounds``, ``median_draft_ms``,
    ``median_verify_ms`` (rounds that verified something) and ``mean_scheduled`` (mean drafts verified ℓ)."""

    rounds: int
    median_draft_ms: float | None
    median_verify_ms: float | None
    mean_scheduled: float | None


@dataclass
class FloorCost(Record):
    """The floor of one DSpark method on one suite (issue #28; :func:`dspark_hf.bench.analysis.prompt_floor`):
    rounds that verified the target's token alone against plain decoding steps of the same prompts, medians over
    prompts in ms.

    ``round_ms`` = ``forward_ms`` (the target's forward, hidden states captured) + ``plan_ms`` (lookup planning)
    + ``bookkeeping_ms`` (DSpark's per-round work: features collected, costs learnt, online updates) + ``loop_ms``
    (transformers' assisted loop, the cache crop included); ``plain_step_ms`` = ``plain_forward_ms`` +
    ``plain_loop_ms``; ``ratio`` = ``round_ms / plain_step_ms`` (median over prompts; ``worst_ratio`` the largest,
    on ``worst_prompt``; ``per_prompt``: each prompt's, by id; both absent in older files).
    ``context_ms_per_token``: the drafter's context extension per position, paid in the next drafted round.
    ``prefill_ms`` / ``prefill_extension_ms``: the target's prefill and the drafter's context extension over the
    prompt (issue #23)."""

    prompts: int
    floor_rounds: int
    round_ms: float | None
    forward_ms: float | None
    plan_ms: float | None
    bookkeeping_ms: float | None
    loop_ms: float | None
    plain_step_ms: float | None
    plain_forward_ms: float | None
    plain_loop_ms: float | None
    ratio: float | None
    worst_ratio: float | None
    context_ms_per_token: float | None
    prefill_ms: float | None
    prefill_extension_ms: float | None
    worst_prompt: str | None = field(default=None, metadata={"omit_none": True})
    per_prompt: dict[str, float] | None = field(default=None, metadata={"omit_none": True})


# ------------------------------------------------------------------------------------------- the result
@dataclass
class BenchResult(Record):
    """One ``dspark bench`` run (``benchmarks.json``).

    Attributes:
        schema_version: :data:`SCHEMA_VERSION`.
        machine: :class:`MachineRecord`. settings: :class:`RunSettings`. suites: ``{suite: SuiteRecord}``.
        drafters: ``{drafter: DrafterRecord}``.
        tau_ratio_dspark_over_dflash: ``tau_ratios["greedy"]``.
        tau_ratios: ``{setting: macro τ(dspark) / macro τ(dflash)}``, ``None`` without both drafters.
        tau: ``{setting: {drafter: {suite | "macro": τ}}}`` under fixed-length verification.
        conditional_acceptance: ``{setting: {suite: {drafter: [P(n ≥ k | n ≥ k-1) for k = 1..γ]}}}`` (``None``
            where no round reached k - 1).
        confidence: ``{drafter: DrafterConfidence}`` for drafters with a confidence head.
        wall_clock: :class:`WallClock`. builtin_dflash: :class:`BuiltinDFlash`. sps: :class:`SPSRecord`.
        round_cost: ``{method: RoundCost}``. notes: what the reader should know about the run.
        floor_cost: ``{method: {suite: FloorCost}}`` for methods with rounds that drafted nothing in the wall-clock
            pass (absent in older files).
        floor_pass: ``{method: {suite: FloorCost}}`` of the floor pass: each drafter's default method with drafting
            forced off (every round verifies the target's token alone), interleaved with plain ``generate``
            ``settings.floor_repeats`` times per prompt (absent in older files and when skipped).
        runtime_s: wall seconds of the whole run. plots: PNG file names next to the JSON (absent until written).
    """

    schema_version: int
    machine: MachineRecord
    settings: RunSettings
    suites: dict[str, SuiteRecord]
    drafters: dict[str, DrafterRecord]
    tau_ratio_dspark_over_dflash: float | None
    tau_ratios: dict[str, float | None]
    tau: dict[str, dict[str, dict[str, float | None]]]
    conditional_acceptance: dict[str, dict[str, dict[str, list[float | None]]]]
    confidence: dict[str, DrafterConfidence]
    wall_clock: WallClock
    builtin_dflash: BuiltinDFlash
    sps: SPSRecord
    round_cost: dict[str, RoundCost]
    notes: list[str]
    runtime_s: float
    plots: list[str] | None = field(default=None, metadata={"omit_none": True})
    floor_cost: dict[str, dict[str, FloorCost]] | None = field(default=None, metadata={"omit_none": True})
    floor_pass: dict[str, dict[str, FloorCost]] | None = field(default=None, metadata={"omit_none": True})

    def strict(self) -> BenchResult:
        """A copy as ``benchmarks.json`` holds it: every NaN or infinite float ``None``."""
        return BenchResult.from_json(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> BenchResult:
        """Read a ``benchmarks.json``."""
        return cls.from_json(json.loads(Path(path).read_text()))

    def dumps(self) -> str:
        """The text of ``benchmarks.json`` (2-space indent, strict JSON, trailing newline)."""
        return json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n"


def as_bench_result(value) -> BenchResult | None:
    """``value`` as a :class:`BenchResult` when it is one or a ``dspark bench`` JSON object (``schema_version`` and
    ``wall_clock`` keys), else ``None`` (e.g. a hand-written dict of metrics)."""
    if isinstance(value, BenchResult):
        return value
    if isinstance(value, dict) and "schema_version" in value and "wall_clock" in value:
        return BenchResult.from_json(value)
    return None
