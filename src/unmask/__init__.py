"""unmask: commit many tokens per forward pass."""

__version__ = "0.1.0"
