"""DSpark speculative decoding for Hugging Face Transformers.

``import dspark_hf`` registers the ``dspark`` model type with the Auto classes and routes
``target.generate(..., assistant_model=DSparkDrafter)`` through DSpark drafting.
"""

from transformers import AutoConfig, AutoModel

from .calibration import SequentialTemperatureScaling
from .config import DSparkConfig
from .generation import DSparkCandidateGenerator, GenerationStats, install
from .kernels import prepack_linears
from .model import DSparkDrafter
from .profiling import NoisySPSWarning, SPSCurve, load_or_profile_sps, profile_sps, save_sps
from .target import load_default_target, load_target

__version__ = "0.1.0"

AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDrafter, exist_ok=True)
DSparkConfig.register_for_auto_class()
DSparkDrafter.register_for_auto_class("AutoModel")
install()

__all__ = [
    "DSparkCandidateGenerator",
    "DSparkConfig",
    "DSparkDrafter",
    "GenerationStats",
    "NoisySPSWarning",
    "SPSCurve",
    "SequentialTemperatureScaling",
    "load_default_target",
    "load_or_profile_sps",
    "load_target",
    "prepack_linears",
    "profile_sps",
    "save_sps",
]
