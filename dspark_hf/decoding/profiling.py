"""The SPS curve: target steps per second when verifying ``B`` tokens at once (paper §3.2.2, §5.2).

The hardware-aware scheduler (:mod:`dspark_hf.scheduler`) needs ``SPS(B)`` for ``B = 1..γ + 1``. The paper
profiles it "once during engine initialization and stored as a lightweight cost table"; here
:func:`profile_sps` measures it on the target's own device, :func:`load_or_profile_sps` keeps one JSON per
(target, device incl. torch thread count, dtype, torch version, linear kernels, context length) under
``cache_root() / "sps"`` (``$HF_HOME/dspark_hf/sps``; delete a file, or run ``dspark profile --refresh``, to
measure again), and :meth:`SPSCurve.observe` refines it online from the verification times that every
speculative round measures anyway (:class:`~dspark_hf.generation.DSparkCandidateGenerator` calls it).

Context length. The curve's SHAPE depends on how many tokens are already in the KV cache (attention over
the cache grows with ``B × context``): on a 2-core CPU verifying 8 tokens costs ~1.1× one token at context
256 but ~2.5× at context 4096. A curve therefore holds one row per measured context length and
:meth:`SPSCurve.at` interpolates the cost in milliseconds linearly between the two nearest rows (clamped
outside them). Online observations go to the row of their context (a new power-of-two row is added, seeded
by interpolation, when no row lies within a factor √2).

Measurement (:func:`profile_sps`): prefill the shortest context's random tokens once into a ``DynamicCache``
and make longer contexts by repeating the cached keys/values (timing does not depend on their values, and a
real prefill of thousands of tokens would cost more than the whole profile). One untimed warm-up sweep over
``B = 1..max_tokens``, then per context timed sweeps until every median is known to ``rel_tol`` (95 %
confidence half-width ``1.57 · IQR / √n``, the boxplot notch of McGill, Tukey and Larsen 1978), or
``max_repeats``, or the context's share of the time budget (default 25 s). A curve whose medians stay wider than ``NOISY_SPREAD`` is marked ``noisy`` and a
:class:`NoisySPSWarning` says so (it is still cached and used: online refinement heals it). Sweeping all ``B``
per repeat, rather than repeating one ``B`` at a time, spreads a burst of load over all sizes instead of
bending the curve at a few of them.

Threads. On a CPU shared with other work, torch's default of one intra-op thread per core collapses: on a
busy 2-core machine a 1-token step of SmolLM2-135M took a median of 1.3 s with 2 threads against 82 ms with
1 (see the README's "Threads and load"). The ``dspark`` commands therefore default to ``--threads 1`` on CPU;
the thread count is part of the cache key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dspark_hf.decoding.kernels import linear_kernels
from dspark_hf.decoding.targets import cache_root

__all__ = [
    "DEFAULT_CONTEXTS",
    "NoisySPSWarning",
    "SPSCurve",
    "device_name",
    "load_or_profile_sps",
    "plot_sps",
    "profile_sps",
    "save_sps",
    "sps_cache_path",
    "time_verify_step",
]

FORMAT_VERSION = 2  # 2 added context_curves, noisy, spread, observations, counts, online (version 1 files still load)
DEFAULT_CONTEXTS = (256, 2048)  # context lengths profiled by default (those that fit); longer ones are learnt online
REL_TOL = 0.05  # stop sweeping once every median is known to ±5 % (95 % confidence)
NOISY_SPREAD = 0.15  # a curve whose medians are still wider than ±15 % is marked noisy
ONLINE_WEIGHT = 0.1  # EMA weight of one observed verification time (in log-milliseconds)
NEIGHBOUR_DECAY = 0.7  # an observation at B moves SPS(B ± d) with weight ONLINE_WEIGHT · NEIGHBOUR_DECAY**d
ENGINE_TABLES = ("sglang", "tensorrt-llm")  # SPSCurve.engine_table formats


class NoisySPSWarning(UserWarning):
    """The SPS curve was measured (or cached) with a spread too wide to trust; see :func:`profile_sps`."""


@dataclass
class SPSCurve:
    """A profiled capacity curve ``SPS(B)``, per context length, and what it was measured on (paper §3.2.2).

    Pass ``curve.at(context_len)`` (or ``curve.steps_per_s`` for the primary context) as the ``sps``
    argument of :mod:`dspark_hf.scheduler` functions.

    Attributes:
        steps_per_s: ``steps_per_s[B - 1]`` = target forward passes per second when verifying ``B``
            tokens with ``context_len`` tokens cached, for ``B = 1..max_tokens``; all ``> 0``.
        target_name: ``target.config._name_or_path`` (``""`` for a model built in memory).
        device_name: e.g. ``"NVIDIA H200"`` or ``"x86_64 (2 cores, 1 torch threads)"``.
        dtype: parameter dtype without the ``torch.`` prefix, e.g. ``"float32"``.
        torch_version: ``torch.__version__`` at measurement time.
        context_len: tokens in the KV cache while timing ``steps_per_s`` (the primary row).
        n_params: number of target parameters (tells apart unnamed models of different sizes).
        linear_kernels: ``"stock"`` or ``"onednn-prepacked"`` (:func:`~dspark_hf.kernels.prepack_linears`
            flattens the CPU curve, so it is part of what a curve was measured on).
        smoothed: whether :meth:`smooth` has been applied.
        context_curves: further rows ``{context length: steps_per_s list}`` (same length as ``steps_per_s``),
            profiled or added by :meth:`observe`.
        noisy: the measurement's spread exceeded ``NOISY_SPREAD`` (re-profile on a quiet machine).
        spread: largest relative 95 % half-width of a median over all ``B`` and contexts (0: not measured here).
        observations: verification times folded in by :meth:`observe` since the curve was measured.
        counts: ``{context row: [observations of B = 1..max_tokens]}`` behind ``observations``.
        online: whether ``generate`` refines the curve with each round's verification time (``False``
            keeps it fixed, so the scheduler's choices are reproducible run to run).

    Raises:
        ValueError: empty curve, a non-positive / non-finite value, or a row of another length.
    """

    steps_per_s: list[float]  # index B - 1
    target_name: str
    device_name: str
    dtype: str
    torch_version: str
    context_len: int  # tokens in the KV cache while timing
    n_params: int
    linear_kernels: str = "stock"  # or "onednn-prepacked" (dspark_hf.kernels); older files: stock
    smoothed: bool = False  # running minimum applied (monotone non-increasing in B)
    context_curves: dict[int, list[float]] = field(default_factory=dict)  # other context lengths
    noisy: bool = False
    spread: float = 0.0
    observations: int = 0
    counts: dict[int, list[int]] = field(default_factory=dict)
    online: bool = True

    def __post_init__(self) -> None:
        self.steps_per_s = [float(s) for s in self.steps_per_s]
        self.context_curves = {int(k): [float(s) for s in v] for k, v in self.context_curves.items()}
        self.counts = {int(k): [int(n) for n in v] for k, v in self.counts.items()}
        for row in (self.steps_per_s, *self.context_curves.values()):
            if not row or not all(0 < s < float("inf") for s in row):
                raise ValueError(f"steps_per_s must be a non-empty list of finite values > 0, got {row}.")
            if len(row) != len(self.steps_per_s):
                raise ValueError(f"every context row must cover B = 1..{len(self.steps_per_s)}, got {len(row)} values.")

    @property
    def max_tokens(self) -> int:
        """Largest ``B`` covered by the curve."""
        return len(self.steps_per_s)

    @property
    def rows(self) -> dict[int, list[float]]:
        """All rows ``{context length: steps_per_s}``, sorted by context (the lists are the curve's own)."""
        return dict(sorted({**self.context_curves, self.context_len: self.steps_per_s}.items()))

    def at(self, context_len: int) -> list[float]:
        """``SPS(B)`` for ``B = 1..max_tokens`` with ``context_len`` tokens cached (a new list).

        The cost in milliseconds is interpolated linearly in the context length between the two nearest
        rows and clamped to the first / last row outside them (attention cost is linear in the context).
        """
        rows = self.rows
        contexts = list(rows)
        if context_len <= contexts[0] or len(contexts) == 1:
            return list(rows[contexts[0]])
        if context_len >= contexts[-1]:
            return list(rows[contexts[-1]])
        hi = next(k for k in contexts if k >= context_len)
        lo = contexts[contexts.index(hi) - 1]
        w = (context_len - lo) / (hi - lo)
        return [1.0 / ((1 - w) / a + w / b) for a, b in zip(rows[lo], rows[hi])]

    def row_for(self, context_len: int) -> int:
        """The context row an observation at ``context_len`` refines (see :meth:`observe`)."""
        contexts = list(self.rows)
        if context_len <= contexts[0]:
            return contexts[0]
        nearest = min(contexts, key=lambda k: abs(math.log2(context_len / k)))
        if abs(math.log2(context_len / nearest)) <= 0.5:
            return nearest
        return 2 ** round(math.log2(context_len))

    def observe(self, n_tokens: int, context_len: int, seconds: float, weight: float = ONLINE_WEIGHT,
                decay: float = NEIGHBOUR_DECAY) -> None:
        """Fold one measured verification time into the curve (online refinement; in place).

        The row of :meth:`row_for` ``(context_len)`` (created from :meth:`at` when new) moves toward the
        observation by an exponential moving average of log-milliseconds,
        ``log ms(b) += weight_b · (log(1e3 · seconds) - log ms(b))`` for every size ``b``, with ``weight_B =
        weight`` for the observed size and ``weight · decay**|b - B| / (1 + n_b)`` for the others (``n_b``: times
        ``b`` itself was observed, :attr:`counts`). Sizes the scheduler never picks are pulled toward what
        their neighbours cost, so a size a bad curve made look too expensive soon looks affordable, gets
        verified and is then measured itself (after which its neighbours' pull fades): a curve wrong
        everywhere heals. In log space one spike of 10× moves the estimate by only ``10**weight`` (1.26×
        at the default).

        Args:
            n_tokens: ``B``, tokens the target verified (``ℓ + 1``), in ``1..max_tokens``.
            context_len: tokens in the KV cache before the verification.
            seconds: measured wall-clock seconds of the verification, ``> 0``.
            weight: EMA weight in ``(0, 1]``.
            decay: neighbour weight factor per step of ``B`` in ``[0, 1]``.

        Raises:
            ValueError: ``n_tokens`` outside the curve, ``seconds <= 0``, ``weight``/``decay`` out of range.
        """
        if not 1 <= n_tokens <= self.max_tokens:
            raise ValueError(f"n_tokens must be in 1..{self.max_tokens} (the curve's B), got {n_tokens}.")
        if not (seconds > 0 and math.isfinite(seconds)) or not 0 < weight <= 1 or not 0 <= decay <= 1:
            raise ValueError(f"need seconds > 0, 0 < weight <= 1, 0 <= decay <= 1; got {seconds}, {weight}, {decay}.")
        key = self.row_for(context_len)
        if key not in self.rows:
            self.context_curves[key] = self.at(key)
        row = self.rows[key]
        counts = self.counts.setdefault(key, [0] * len(row))
        for b in range(len(row)):  # row[b] = SPS(b + 1) = 1e3 / ms(b + 1)
            delta = math.log(seconds * row[b])  # log(observed ms / modelled ms of size b + 1)
            w = weight if b + 1 == n_tokens else weight * decay ** abs(b + 1 - n_tokens) / (1 + counts[b])
            row[b] *= math.exp(-w * delta)
        counts[n_tokens - 1] += 1
        self.observations += 1

    def smooth(self) -> SPSCurve:
        """Copy with every row made monotone non-increasing in ``B`` by a running minimum (paper §5.2:
        real curves are jagged)."""
        def running_min(row):
            out, low = [], float("inf")
            for s in row:
                low = min(low, s)
                out.append(low)
            return out

        return dataclasses.replace(self, steps_per_s=running_min(self.steps_per_s), smoothed=True,
                                   context_curves={k: running_min(v) for k, v in self.context_curves.items()})

    def table(self) -> str:
        """Plain-text table: milliseconds per verification step, one column per context row."""
        rows = self.rows
        head = "    B" + "".join(f"{f'ctx {k} ms':>13}" for k in rows)
        lines = [head] + [f"{b:5d}" + "".join(f"{1e3 / r[b - 1]:13.1f}" for r in rows.values())
                          for b in range(1, self.max_tokens + 1)]
        if self.noisy:
            lines.append(f"noisy: medians known only to ±{100 * self.spread:.0f} % (re-profile on a quieter machine)")
        return "\n".join(lines)

    def engine_table(self, engine: str) -> dict:
        """The curve as the cost table a serving engine reads (issue #11).

        ``B`` here is what the engines index by: tokens in one verification forward (bonus included).

        Args:
            engine: ``"sglang"``: the JSON of ``--speculative-dspark-sps-table-path``
                (``sample_batch_tokens`` = ``1..max_tokens``, ``sample_steps_per_sec``, ``max_batch_tokens``);
                ``"tensorrt-llm"``: the confidence-scheduler cost table (``token_counts``,
                ``step_time_ms`` = ``1000 / SPS(B)``, ``fixed_overhead_ms`` = 0: the steps were timed whole).

        Returns:
            A JSON-serialisable dict with exactly the keys that engine reads.

        Raises:
            ValueError: unknown ``engine``.
        """
        tokens = list(range(1, self.max_tokens + 1))
        if engine == "sglang":
            return {"sample_batch_tokens": tokens, "sample_steps_per_sec": list(self.steps_per_s),
                    "max_batch_tokens": self.max_tokens}
        if engine == "tensorrt-llm":
            return {"token_counts": tokens, "step_time_ms": [1e3 / s for s in self.steps_per_s], "fixed_overhead_ms": 0.0}
        raise ValueError(f"engine must be one of {ENGINE_TABLES}, got {engine!r}")

    def to_json(self) -> str:
        """JSON text with every field plus ``format_version``."""
        return json.dumps({"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> SPSCurve:
        """Inverse of :meth:`to_json` (also reads format 1, which had one context row).

        Raises:
            ValueError: unknown ``format_version`` or malformed content.
        """
        payload = json.loads(text)
        version = payload.pop("format_version", None)
        if version not in (1, FORMAT_VERSION):
            raise ValueError(f"unsupported SPS curve format_version {version!r} (this dspark-hf reads 1 and "
                             f"{FORMAT_VERSION}); delete the file to re-profile.")
        return cls(**payload)


def device_name(device: torch.device) -> str:
    """Human-readable name of the device timings depend on.

    Returns:
        CUDA: ``torch.cuda.get_device_name``; otherwise the CPU's name or machine type, core count and
        torch's intra-op thread count (which changes CPU timings as much as the chip does).
    """
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    cpu = platform.processor() or platform.machine() or "cpu"
    return f"{cpu} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _describe(target: torch.nn.Module) -> dict:
    """Metadata of ``target`` that identifies its SPS curve (everything but the measurement)."""
    param = next(target.parameters())
    return {
        "target_name": str(getattr(target.config, "_name_or_path", "") or ""),
        "device_name": device_name(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
        "torch_version": torch.__version__,
        "n_params": sum(p.numel() for p in target.parameters()),
        "linear_kernels": linear_kernels(target),
    }


@torch.inference_mode()
def time_verify_step(target: torch.nn.Module, cache: DynamicCache, input_ids: torch.Tensor) -> float:
    """Time one verification forward of ``input_ids`` against ``cache``, then crop the cache back.

    Args:
        target: a causal LM accepting ``input_ids=`` and ``cache=`` (transformers 5.x).
        cache: a filled ``DynamicCache``; its length is the same on return.
        input_ids: ``torch.LongTensor`` of shape ``(1, B)`` on the target's device.

    Returns:
        Wall-clock seconds of the forward (CUDA is synchronized before and after).
    """
    is_cuda = input_ids.device.type == "cuda"
    if is_cuda:  # start from an idle device so earlier queued work is not timed
        torch.cuda.synchronize(input_ids.device)
    start = time.perf_counter()
    target(input_ids=input_ids, cache=cache, use_cache=True)
    if is_cuda:  # kernels are asynchronous: wait for them before reading the clock
        torch.cuda.synchronize(input_ids.device)
    elapsed = time.perf_counter() - start
    cache.crop(-input_ids.shape[1])  # transformers 5.x: negative count of tokens to drop
    return elapsed


def _check_profile_args(target: torch.nn.Module, max_tokens: int, context_len: int, max_repeats: int,
                        min_repeats: int) -> int | None:
    """Raise ``ValueError`` early for arguments the measurement cannot honour; return the position limit."""
    if max_tokens < 1 or context_len < 1 or min_repeats < 2 or max_repeats < min_repeats:
        raise ValueError("max_tokens and context_len must be >= 1, min_repeats >= 2 (a spread needs two timings) "
                         f"and max_repeats >= min_repeats, got {max_tokens}, {context_len}, {min_repeats}, {max_repeats}.")
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and context_len + max_tokens > limit:
        raise ValueError(f"context_len + max_tokens = {context_len + max_tokens} exceeds the target's "
                         f"max_position_embeddings = {limit}; lower context_len or max_tokens.")
    return limit


def _relative_spread(times: Sequence[float]) -> float:
    """Relative 95 % half-width of the median of ``times`` (``n >= 2``): ``1.57 · IQR / √n / median``
    (McGill, Tukey and Larsen 1978)."""
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return 1.57 * (q3 - q1) / math.sqrt(len(times)) / statistics.median(times)


def _grow_cache(target: torch.nn.Module, kv: DynamicCache, context_len: int) -> None:
    """Lengthen ``kv`` to ``context_len`` tokens by repeating its keys/values (a real prefill where the
    cache has layers other than plain :class:`DynamicLayer`, e.g. sliding windows)."""
    have = kv.get_seq_length()
    if context_len <= have:
        return
    if all(type(layer) is DynamicLayer for layer in kv.layers):
        reps = -(-context_len // have)
        for layer in kv.layers:
            layer.keys = layer.keys.repeat(1, 1, reps, 1)[:, :, :context_len].contiguous()
            layer.values = layer.values.repeat(1, 1, reps, 1)[:, :, :context_len].contiguous()
        return
    vocab = target.get_input_embeddings().num_embeddings
    extra = torch.randint(vocab, (1, context_len - have), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        target(input_ids=extra.to(next(target.parameters()).device), cache=kv, use_cache=True)


def _measure_row(target, kv, blocks, rel_tol: float, min_repeats: int, max_repeats: int, share_end: float,
                 hard_end: float, bar) -> tuple[list[float], float]:
    """Timed sweeps over ``blocks`` until the stopping rule holds: ``(steps_per_s, spread)``.

    Stops once ``min_repeats`` sweeps are done and every median is tight or this context's share of the
    budget (``share_end``) is spent; stops after 2 sweeps, whatever the spread, once ``hard_end`` has passed.
    """
    seconds = [[] for _ in blocks]
    for sweep in range(1, max_repeats + 1):
        for block, times in zip(blocks, seconds):
            times.append(time_verify_step(target, kv, block))
        bar.update(1)
        if sweep < 2:
            continue
        spread = max(_relative_spread(times) for times in seconds)
        now = time.perf_counter()
        if (sweep >= min_repeats and (spread <= rel_tol or now >= share_end)) or now >= hard_end:
            break
    return [1.0 / statistics.median(times) for times in seconds], spread


def profile_sps(
    target: torch.nn.Module,
    max_tokens: int = 8,
    context_len: int = 256,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    rel_tol: float = REL_TOL,
    min_repeats: int = 3,
    max_repeats: int = 30,
    time_budget_s: float = 25.0,
    smooth: bool = False,
    cache: bool = True,
    progress: bool = True,
) -> SPSCurve:
    """Measure ``SPS(B)`` for ``B = 1..max_tokens`` at several context lengths (paper §3.2.2).

    Always measures (use :func:`load_or_profile_sps` to reuse a stored curve). Random token ids from a
    fixed seed, batch size 1; the global RNG is untouched. Runs the target in whatever train/eval mode
    it is in (load targets with ``.eval()``). See the module docstring for the stopping rule.

    Args:
        target: causal LM (transformers 5.x) with ``config`` and ``get_input_embeddings``.
        max_tokens: largest verification size ``B`` (the drafter's ``γ + 1``; more costs time for nothing).
        context_len: the primary row's context (tokens prefilled into the KV cache).
        contexts: further context lengths to measure; those beyond ``max_position_embeddings - max_tokens``
            are skipped. All rows are measured shortest first on one growing cache.
        rel_tol: stop once every median's relative 95 % half-width is at most this.
        min_repeats / max_repeats: timed sweeps per context, at least (within the budget) / at most.
        time_budget_s: wall-clock seconds for the whole profile (target loading excluded), shared evenly by
            the contexts not yet measured. Past it a context stops after 2 sweeps and further contexts other
            than ``context_len`` are skipped (:meth:`SPSCurve.observe` adds their rows online).
        smooth: return the running-minimum curve (monotone non-increasing); the cache keeps raw values.
        cache: also write the raw curve to :func:`sps_cache_path` (replacing any stored one).
        progress: show a tqdm bar over the sweeps.

    Returns:
        :class:`SPSCurve` in forward passes per second, ``noisy`` set when the spread stayed above
        ``NOISY_SPREAD``.

    Raises:
        ValueError: ``max_tokens`` or ``context_len`` below 1, ``min_repeats`` below 2, ``max_repeats <
            min_repeats``, or ``context_len + max_tokens`` beyond ``max_position_embeddings``.

    Warns:
        NoisySPSWarning: the curve is noisy (other load on the machine); it is cached and used anyway.
    """
    limit = _check_profile_args(target, max_tokens, context_len, max_repeats, min_repeats)
    order = sorted({c for c in contexts if c > 0 and (limit is None or c + max_tokens <= limit)} | {context_len})
    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    kv = DynamicCache(config=target.config)
    start = time.perf_counter()
    with torch.inference_mode():
        context = torch.randint(vocab, (1, order[0]), generator=generator).to(device)  # (1, shortest context)
        target(input_ids=context, cache=kv, use_cache=True)  # prefill once
    blocks = [torch.randint(vocab, (1, b), generator=generator).to(device) for b in range(1, max_tokens + 1)]  # (1, B)
    rows, spreads = {}, []
    hard_end = start + time_budget_s
    with tqdm(desc="Profiling SPS(B)", unit="sweep", disable=not progress) as bar:
        for block in blocks:  # one untimed sweep: allocator, kernel selection
            time_verify_step(target, kv, block)
        for i, ctx in enumerate(order):
            if ctx != context_len and time.perf_counter() >= hard_end:
                continue  # out of time: online refinement adds this row when such contexts occur
            _grow_cache(target, kv, ctx)
            share_end = time.perf_counter() + (hard_end - time.perf_counter()) / (len(order) - i)
            bar.set_postfix(context=ctx)
            rows[ctx], spread = _measure_row(target, kv, blocks, rel_tol, min_repeats, max_repeats, share_end,
                                             hard_end, bar)
            spreads.append(spread)
    spread = max(spreads)
    curve = SPSCurve(steps_per_s=rows.pop(context_len), context_len=context_len, context_curves=rows,
                     noisy=spread > NOISY_SPREAD, spread=spread, **_describe(target))
    if curve.noisy:
        warnings.warn(_noisy_message(curve), NoisySPSWarning, stacklevel=2)
    if cache:
        _write(curve, sps_cache_path(target, context_len))
    return curve.smooth() if smooth else curve


def _noisy_message(curve: SPSCurve) -> str:
    return (f"The SPS curve of {curve.target_name or 'this target'} is noisy (medians known only to "
            f"±{100 * curve.spread:.0f} %): the machine has other load. It is used anyway and refined online from "
            "each round's verification time; for a clean one run `dspark profile --refresh` on a quiet machine "
            "(and keep --threads 1 on a shared CPU).")


def sps_cache_path(target: torch.nn.Module, context_len: int = 256) -> Path:
    """Where the SPS curve of ``target`` on its current device is stored.

    ``cache_root() / "sps" / "<name>-<dtype>-ctx<context_len>-<hash>.json"``; the hash covers target name,
    parameter count, device name (incl. torch's thread count), dtype, torch version, linear kernels and
    ``context_len``. ``cache_root()`` follows ``HF_HOME`` at call time. Delete the file to re-profile.
    """
    key = {**_describe(target), "context_len": context_len}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key["target_name"].rstrip("/").split("/")[-1]) or "unnamed"
    return cache_root() / "sps" / f"{name}-{key['dtype']}-ctx{context_len}-{digest}.json"


def _write(curve: SPSCurve, path: Path) -> None:
    """Write ``curve`` atomically (a concurrent reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    tmp.write_text(curve.to_json())
    tmp.replace(path)


def save_sps(curve: SPSCurve, target: torch.nn.Module) -> Path:
    """Store ``curve`` (e.g. after online refinement) as the cached curve of ``target``; returns the path."""
    path = sps_cache_path(target, curve.context_len)
    _write(curve, path)
    return path


def load_or_profile_sps(
    target: torch.nn.Module,
    max_tokens: int = 8,
    context_len: int = 256,
    smooth: bool = False,
    progress: bool = True,
    **profile_kwargs,
) -> SPSCurve:
    """The stored SPS curve for ``target`` on its device, profiling and storing it on a miss (paper §3.2.2).

    A stored curve shorter than ``max_tokens`` counts as a miss (it is measured again, to ``max_tokens``).

    Args:
        Same as :func:`profile_sps` (``profile_kwargs`` and ``progress`` matter only on a miss).

    Returns:
        :class:`SPSCurve` (smoothed on request; the stored file keeps raw values).

    Raises:
        ValueError: as :func:`profile_sps`, or a stored file of an unknown format version.

    Warns:
        NoisySPSWarning: the stored or new curve is marked noisy.
    """
    path = sps_cache_path(target, context_len)
    curve = SPSCurve.from_json(path.read_text()) if path.is_file() else None
    if curve is not None and curve.max_tokens >= max_tokens:
        if curve.noisy:
            warnings.warn(_noisy_message(curve) + f" (cached in {path})", NoisySPSWarning, stacklevel=2)
    else:
        curve = profile_sps(target, max_tokens, context_len, smooth=False, cache=True, progress=progress,
                            **profile_kwargs)
    return curve.smooth() if smooth else curve


def plot_sps(curve: SPSCurve, path: str | os.PathLike) -> Path:
    """Write a PNG of ``curve``: milliseconds per verification step against ``B``, one line per context row.

    Needs matplotlib (imported here, not with the package). Returns the path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0, 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    sizes = range(1, curve.max_tokens + 1)
    for context, row in curve.rows.items():
        ax.plot(sizes, [1e3 / s for s in row], marker="o", markersize=3, label=f"context {context}")
    ax.set_xlabel("B (tokens verified per target step)")
    ax.set_ylabel("ms per verification step")
    ax.set_ylim(bottom=0)
    note = f" · NOISY (±{100 * curve.spread:.0f} %)" if curve.noisy else ""
    ax.set_title(f"SPS curve · {curve.device_name}{note}", fontsize=9)
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
