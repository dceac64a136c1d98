"""The one description of the machine timings depend on: CPU, cores, torch threads, GPU and library versions.

Read by the SPS profile (:func:`device_name`, part of the cached curve's key),
``dspark bench`` (``benchmarks.json``'s ``machine``) and ``dspark info``.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Machine", "cpu_model", "describe_machine", "device_name"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``, e.g. ``"AMD EPYC"``), else the processor or
    machine type that :mod:`platform` reports (e.g. ``"x86_64"``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Machine:
    """What this process runs on, as timings depend on it.

    Attributes:
        cpu: the CPU model (:func:`cpu_model`).
        arch: the processor or machine type (``platform.processor()`` or ``platform.machine()``, e.g. ``"x86_64"``;
            ``"cpu"`` when neither is known).
        isa: the vector instruction set torch's CPU kernels dispatch to (``torch.backends.cpu.get_cpu_capability()``,
            e.g. ``"AVX2"`` or ``"AVX512"``): two CPUs of one model name can differ in it, and which kernel is faster
            (and so the SPS curve) with them.
        cores: logical CPUs (``os.cpu_count()``; ``None`` when unknown).
        torch_threads: torch's intra-op threads (``torch.get_num_threads()``), which change CPU timings as much as
            the chip does.
        cuda: the first CUDA device's name, ``None`` without CUDA.
        torch: ``torch.__version__``.
        transformers: ``transformers.__version__``.
        python: the Python version, e.g. ``"3.11.7"``.
        platform: ``platform.platform()`` (OS, kernel, libc).
    """

    cpu: str
    arch: str
    isa: str
    cores: int | None
    torch_threads: int
    cuda: str | None
    torch: str
    transformers: str
    python: str
    platform: str

    @property
    def cpu_label(self) -> str:
        """``"AMD EPYC AVX2 (2 cores, 1 torch threads)"``: the CPU as SPS curves name their device (part of a cached
        curve's key, so a curve measured on another CPU model or instruction set is not reused)."""
        return f"{self.cpu} {self.isa} ({self.cores} cores, {self.torch_threads} torch threads)"

    @property
    def device(self) -> str:
        """``"cuda"`` when CUDA is available, else ``"cpu"``."""
        return "cuda" if self.cuda is not None else "cpu"


def describe_machine() -> Machine:
    """The :class:`Machine` this process runs on, read now (``torch_threads`` follows ``torch.set_num_threads``)."""
    import transformers

    return Machine(
        cpu=cpu_model(),
        arch=platform.processor() or platform.machine() or "cpu",
        isa=torch.backends.cpu.get_cpu_capability(),
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
    )


def device_name(device: torch.device, machine: Machine | None = None) -> str:
    """Human-readable name of the device timings depend on (part of the SPS cache key: keep it stable).

    Args:
        device: the target's device.
        machine: the :class:`~dspark_hf.runtime.machine.Machine` to describe (default: this one, read now).

    Returns:
        CUDA: ``torch.cuda.get_device_name``; otherwise the CPU model, its instruction set, core count and torch's
        intra-op thread count (which changes CPU timings as much as the chip does): :attr:`Machine.cpu_label`.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    return (machine or describe_machine()).cpu_label
