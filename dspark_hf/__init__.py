"""DSpark speculative decoding for Hugging Face Transformers.

``import dspark_hf`` registers the ``dspark`` model type with the Auto classes, plugs the package's calibration,
CPU kernels and checkpoint converters into the drafter (``modeling_dspark.EXTENSIONS``), and routes
``target.generate(..., assistant_model=DSparkDrafter)`` through DSpark drafting (``dspark_hf.decoding.routing``;
``dspark_hf.uninstall()`` undoes it).

Layers (imports point one way; ``tests/test_layering.py`` checks it):
``modeling`` ← ``decoding`` ← {``training``, ``evaluation``} ← {``bench``, ``hub``, ``demo``} ← ``cli``,
with ``defaults`` (paths and ids) and ``metrics`` (pure maths) below every layer but ``modeling``.
"""

from transformers import AutoConfig, AutoModel

from .decoding.batch_generate import generate_concurrent
from .decoding.calibration import SequentialTemperatureScaling
from .decoding.candidate_generator import DSparkCandidateGenerator
from .decoding.concurrent import ConcurrentDecoder
from .decoding.kernels import pack_rows, prepack_linears
from .decoding.profiling import load_or_profile_sps, profile_sps, save_sps
from .decoding.routing import install, uninstall
from .decoding.sps import NoisySPSWarning, SPSCurve
from .decoding.stats import BatchStats, GenerationStats
from .decoding.targets import load_default_target, load_target
from .defaults import __version__ as __version__
from .defaults import check_local_path
from .modeling.configuration_dspark import DSparkConfig
from .modeling.modeling_dspark import EXTENSIONS, DSparkDrafter


def _import_checkpoint(path, config_dict, hub_kwargs):
    """A speculators or DeepSpec checkpoint converted on load (``dspark_hf.hub.export``, imported when needed)."""
    from .hub.export import import_checkpoint

    return import_checkpoint(path, config_dict, hub_kwargs)


EXTENSIONS.check_path = check_local_path
EXTENSIONS.load_calibration = SequentialTemperatureScaling.load
EXTENSIONS.pack_rows = pack_rows
EXTENSIONS.import_checkpoint = _import_checkpoint

AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDrafter, exist_ok=True)
DSparkConfig.register_for_auto_class()
DSparkDrafter.register_for_auto_class("AutoModel")
install()

__all__ = [
    "BatchStats",
    "ConcurrentDecoder",
    "DSparkCandidateGenerator",
    "DSparkConfig",
    "DSparkDrafter",
    "GenerationStats",
    "NoisySPSWarning",
    "SPSCurve",
    "SequentialTemperatureScaling",
    "generate_concurrent",
    "install",
    "load_default_target",
    "load_or_profile_sps",
    "load_target",
    "prepack_linears",
    "profile_sps",
    "save_sps",
    "uninstall",
]
