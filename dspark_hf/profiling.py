"""The SPS curve: target steps per second when verifying ``B`` tokens at once (paper §3.2.2, §5.2).

The hardware-aware scheduler (:mod:`dspark_hf.scheduler`) needs ``SPS(B)`` for ``B = 1..max_tokens``.
The paper profiles it "once during engine initialization and stored as a lightweight cost table";
here :func:`profile_sps` measures it on the target's own device and :func:`load_or_profile_sps` keeps
one JSON per (target, device, dtype, torch version, context length, max tokens) under
``cache_root() / "sps"``.

Measurement: prefill ``context_len`` random tokens once into a ``DynamicCache``; sweep ``B = 1..max_tokens``
once untimed (warm-up), then ``repeats`` timed sweeps, and keep the median per ``B``. Each timing is a forward
of ``B`` new tokens against that cache, cropped back afterwards so every timing sees the same context length.
Sweeping all ``B`` per repeat, rather than repeating one ``B`` at a time, spreads a burst of load over all
sizes instead of bending the curve at a few of them (on a busy 2-core machine the one-``B``-at-a-time curve
had 8-token steps cheaper than 6- and 7-token ones).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from dspark_hf.kernels import linear_kernels
from dspark_hf.target import cache_root

__all__ = ["SPSCurve", "device_name", "load_or_profile_sps", "profile_sps", "sps_cache_path", "time_verify_step"]

FORMAT_VERSION = 1
ENGINE_TABLES = ("sglang", "tensorrt-llm")  # SPSCurve.engine_table formats


@dataclass
class SPSCurve:
    """A profiled capacity curve ``SPS(B)`` and what it was measured on (paper §3.2.2).

    Pass ``curve.steps_per_s`` as the ``sps`` argument of :mod:`dspark_hf.scheduler` functions.

    Attributes:
        steps_per_s: ``steps_per_s[B - 1]`` = target forward passes per second when verifying ``B``
            tokens, for ``B = 1..max_tokens``; all ``> 0``.
        target_name: ``target.config._name_or_path`` (``""`` for a model built in memory).
        device_name: e.g. ``"NVIDIA H200"`` or ``"x86_64 (2 cores, 1 torch threads)"``.
        dtype: parameter dtype without the ``torch.`` prefix, e.g. ``"float32"``.
        torch_version: ``torch.__version__`` at measurement time.
        context_len: tokens already in the KV cache while timing.
        n_params: number of target parameters (tells apart unnamed models of different sizes).
        linear_kernels: ``"stock"`` or ``"onednn-prepacked"`` (:func:`~dspark_hf.kernels.prepack_linears`
            flattens the CPU curve, so it is part of what a curve was measured on).
        smoothed: whether :meth:`smooth` has been applied.

    Raises:
        ValueError: empty curve or a non-positive / non-finite value.
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

    def __post_init__(self) -> None:
        self.steps_per_s = [float(s) for s in self.steps_per_s]
        if not self.steps_per_s or not all(0 < s < float("inf") for s in self.steps_per_s):
            raise ValueError(f"steps_per_s must be a non-empty list of finite values > 0, got {self.steps_per_s}.")

    @property
    def max_tokens(self) -> int:
        """Largest ``B`` covered by the curve."""
        return len(self.steps_per_s)

    def smooth(self) -> SPSCurve:
        """Copy made monotone non-increasing in ``B`` by a running minimum (paper §5.2: real curves are jagged)."""
        running, out = float("inf"), []
        for s in self.steps_per_s:
            running = min(running, s)
            out.append(running)
        return dataclasses.replace(self, steps_per_s=out, smoothed=True)

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
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: unknown ``format_version`` or malformed content.
        """
        payload = json.loads(text)
        version = payload.pop("format_version", None)
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported SPS curve format_version {version!r} (this dspark-hf reads "
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


def _check_profile_args(target: torch.nn.Module, max_tokens: int, context_len: int, repeats: int) -> None:
    """Raise ``ValueError`` early for arguments the measurement cannot honour."""
    if max_tokens < 1 or context_len < 1 or repeats < 1:
        raise ValueError("max_tokens, context_len and repeats must be >= 1, "
                         f"got {max_tokens}, {context_len}, {repeats}.")
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and context_len + max_tokens > limit:
        raise ValueError(f"context_len + max_tokens = {context_len + max_tokens} exceeds the target's "
                         f"max_position_embeddings = {limit}; lower context_len or max_tokens.")


def profile_sps(
    target: torch.nn.Module,
    max_tokens: int = 32,
    context_len: int = 256,
    repeats: int = 9,
    smooth: bool = False,
    cache: bool = True,
    progress: bool = True,
) -> SPSCurve:
    """Measure ``SPS(B)`` for ``B = 1..max_tokens`` on the target's device (paper §3.2.2).

    Always measures (use :func:`load_or_profile_sps` to reuse a stored curve). Random token ids from a
    fixed seed, batch size 1; the global RNG is untouched. Runs the target in whatever train/eval mode
    it is in (load targets with ``.eval()``).

    Args:
        target: causal LM (transformers 5.x) with ``config`` and ``get_input_embeddings``.
        max_tokens: largest verification size ``B`` (the drafter's ``γ + 1`` at least).
        context_len: tokens prefilled into the KV cache before timing.
        repeats: timed sweeps over ``B = 1..max_tokens`` after one warm-up sweep; the median per ``B`` is kept.
        smooth: return the running-minimum curve (monotone non-increasing); the cache keeps raw values.
        cache: also write the raw curve to :func:`sps_cache_path` (replacing any stored one).
        progress: show a tqdm bar over the sweeps.

    Returns:
        :class:`SPSCurve` with ``steps_per_s[B - 1]`` in forward passes per second.

    Raises:
        ValueError: a count below 1, or ``context_len + max_tokens`` beyond ``max_position_embeddings``.
    """
    _check_profile_args(target, max_tokens, context_len, repeats)
    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    kv = DynamicCache(config=target.config)
    with torch.inference_mode():
        context = torch.randint(vocab, (1, context_len), generator=generator).to(device)  # (1, context_len)
        target(input_ids=context, cache=kv, use_cache=True)  # prefill once
    blocks = [torch.randint(vocab, (1, b), generator=generator).to(device) for b in range(1, max_tokens + 1)]  # (1, B)
    seconds = [[] for _ in blocks]
    for sweep in tqdm(range(repeats + 1), desc="Profiling SPS(B)", unit="sweep", disable=not progress):
        for block, times in zip(blocks, seconds):
            elapsed = time_verify_step(target, kv, block)
            if sweep:  # sweep 0 warms up: allocator, kernel selection
                times.append(elapsed)
    steps_per_s = [1.0 / statistics.median(times) for times in seconds]
    curve = SPSCurve(steps_per_s=steps_per_s, context_len=context_len, **_describe(target))
    if cache:
        _write(curve, sps_cache_path(target, max_tokens, context_len))
    return curve.smooth() if smooth else curve


def sps_cache_path(target: torch.nn.Module, max_tokens: int = 32, context_len: int = 256) -> Path:
    """Where the SPS curve of ``target`` on its current device is stored.

    ``cache_root() / "sps" / "<name>-<dtype>-ctx<context_len>-b<max_tokens>-<hash>.json"``; the hash
    covers target name, parameter count, device name, dtype, torch version, linear kernels, context_len
    and max_tokens.
    ``cache_root()`` follows ``HF_HOME`` at call time.
    """
    key = {**_describe(target), "context_len": context_len, "max_tokens": max_tokens}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key["target_name"].rstrip("/").split("/")[-1]) or "unnamed"
    return cache_root() / "sps" / f"{name}-{key['dtype']}-ctx{context_len}-b{max_tokens}-{digest}.json"


def _write(curve: SPSCurve, path: Path) -> None:
    """Write ``curve`` atomically (a concurrent reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    tmp.write_text(curve.to_json())
    tmp.replace(path)


def load_or_profile_sps(
    target: torch.nn.Module,
    max_tokens: int = 32,
    context_len: int = 256,
    repeats: int = 9,
    smooth: bool = False,
    progress: bool = True,
) -> SPSCurve:
    """The stored SPS curve for ``target`` on its device, profiling and storing it on a miss (paper §3.2.2).

    Args:
        Same as :func:`profile_sps` (``repeats`` and ``progress`` matter only on a miss).

    Returns:
        :class:`SPSCurve` (smoothed on request; the stored file keeps raw values).

    Raises:
        ValueError: as :func:`profile_sps`, or a stored file of an unknown format version.
    """
    path = sps_cache_path(target, max_tokens, context_len)
    if path.is_file():
        curve = SPSCurve.from_json(path.read_text())
    else:
        curve = profile_sps(target, max_tokens, context_len, repeats, smooth=False, cache=True, progress=progress)
    return curve.smooth() if smooth else curve
