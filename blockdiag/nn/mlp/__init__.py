"""``GroupedMLP``: ``heads`` independent MLPs (the forum's loop of heads) as one module.

The module and the paths that run it (``model``), how it chooses among them (``strategy``),
which activations it takes (``activations``), and the conversions from and to a list of
heads (``heads``).
"""

from .activations import ELEMENTWISE_ACTIVATIONS
from .model import GroupedMLP
from .strategy import STRATEGIES, MLPPlan

__all__ = ["ELEMENTWISE_ACTIVATIONS", "STRATEGIES", "GroupedMLP", "MLPPlan"]
