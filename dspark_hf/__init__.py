"""DSpark speculative decoding for Hugging Face Transformers.

``import dspark_hf`` is cheap (no torch): the names below are imported on first use. That first use of any of them
(``dspark_hf.DSparkDrafter``, ``dspark_hf.load_default_target()``, ``from dspark_hf import SPSCurve``…) also wires
the package, once (:func:`wire`): it registers the ``dspark`` model type with the Auto classes, plugs the package's
calibration, CPU kernels and checkpoint converters into the drafter (``modeling_dspark.EXTENSIONS``), and routes
``target.generate(..., assistant_model=DSparkDrafter)`` through DSpark drafting (``dspark_hf.decoding.routing``;
``dspark_hf.uninstall()`` undoes it). So does building the first ``DSparkDrafter`` of a process, however its class
was imported, and the ``dspark`` command before running a command. Those are the only points: importing a module of
the package (``import dspark_hf.metrics``, ``dspark_hf.decoding.routing`` itself...) patches nothing.

Layers (imports point one way; ``tests/test_layering.py`` checks it):
``modeling`` ← ``runtime`` ← {``decoding``, ``sources``} ← {``training``, ``evaluation``} ← {``bench``, ``hub``,
``demo``} ← ``cli``, with ``defaults`` (paths and ids) and ``metrics`` (pure maths) below every layer but ``modeling``.
"""

from importlib import import_module

from .defaults import __version__ as __version__

_PUBLIC = {  # name -> the module that defines it
    "BatchStats": "decoding.stats",
    "ConcurrentDecoder": "decoding.concurrent",
    "DSparkCandidateGenerator": "decoding.candidate_generator",
    "DSparkConfig": "modeling.configuration_dspark",
    "DSparkDrafter": "modeling.modeling_dspark",
    "GenerationStats": "decoding.stats",
    "NoisySPSWarning": "runtime.sps",
    "SPSCurve": "runtime.sps",
    "SequentialTemperatureScaling": "decoding.calibration",
    "install": "decoding.routing",
    "load_default_target": "runtime.targets",
    "load_or_profile_sps": "runtime.profiling",
    "load_target": "runtime.targets",
    "pack_rows": "runtime.kernels",
    "prepack_linears": "runtime.kernels",
    "profile_sps": "runtime.profiling",
    "save_sps": "runtime.profiling",
    "uninstall": "decoding.routing",
    "check_local_path": "defaults",
    "generate_concurrent": "decoding.batch_generate",
}
_wired = False


def _import_checkpoint(path, config_dict, hub_kwargs):
    """A speculators or DeepSpec checkpoint converted on load (``dspark_hf.hub.export``, imported when needed)."""
    from .hub.export import import_checkpoint

    return import_checkpoint(path, config_dict, hub_kwargs)


def wire() -> None:
    """Register with the Auto classes, fill the drafter's extension points and route ``generate`` (once)."""
    global _wired
    if _wired:
        return
    from transformers import AutoConfig, AutoModel

    from .decoding.calibration import SequentialTemperatureScaling
    from .decoding.routing import install
    from .defaults import check_local_path
    from .modeling.configuration_dspark import DSparkConfig
    from .modeling.modeling_dspark import EXTENSIONS, DSparkDrafter
    from .runtime.kernels import pack_rows

    EXTENSIONS.check_path = check_local_path
    EXTENSIONS.load_calibration = SequentialTemperatureScaling.load
    EXTENSIONS.pack_rows = pack_rows
    EXTENSIONS.import_checkpoint = _import_checkpoint
    AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
    AutoModel.register(DSparkConfig, DSparkDrafter, exist_ok=True)
    DSparkConfig.register_for_auto_class()
    DSparkDrafter.register_for_auto_class("AutoModel")
    install()
    _wired = True


def __getattr__(name: str):
    """Import a public name on first use, wiring the package first (module ``__getattr__``, PEP 562)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dspark_hf' has no attribute {name!r}")
    wire()
    value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = sorted(n for n in _PUBLIC if n not in ("pack_rows", "check_local_path"))
