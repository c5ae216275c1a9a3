"""Layers: :class:`GroupedLinear` and :class:`GroupedMLP`."""

from .linear import GroupedLinear, grouped_linear
from .mlp import GroupedMLP

__all__ = ["GroupedLinear", "GroupedMLP", "grouped_linear"]
