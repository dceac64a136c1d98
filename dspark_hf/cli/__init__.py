"""The ``dspark`` command line: one thin module per command (``python -m dspark_hf.cli``)."""

from .main import main

__all__ = ["main"]
