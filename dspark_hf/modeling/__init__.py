"""The drafter itself: config, backbone, heads and model. torch + transformers only; these files are exactly the
remote code a drafter's Hub repo ships for ``trust_remote_code`` (``dspark card`` writes them)."""

from .configuration_dspark import DSparkConfig
from .modeling_dspark import DSparkDrafter

__all__ = ["DSparkConfig", "DSparkDrafter"]
