"""trainbox: one reproducible environment for training language models."""

__version__ = "0.1.0"
