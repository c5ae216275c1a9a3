"""blockdiag: many small independent linear layers as one fast block-diagonal operation.

Everything public is listed in ``__all__``; other modules may change without notice.

>>> import torch, blockdiag
>>> layer = blockdiag.GroupedLinear(4 * 150, 4 * 10, groups=4)
>>> layer(torch.randn(32, 600)).shape
torch.Size([32, 40])
"""

from ._errors import BlockDiagError
from .backends import Problem
from .backends._registry import BackendInfo
from .backends._registry import names as _names
from .backends._registry import registry as _registry
from .settings import Settings, config, get_settings, set_config, set_sparsity_threshold
from .construct import (
    block_diag_bsr,
    block_diag_coo,
    block_diag_csr,
    block_diag_dense,
    block_diag_mask,
    from_scipy,
    to_blocks,
    to_scipy,
)
from .dispatch import Candidate, Plan, choose
from .masked import mask_block_diagonal_, remove_block_diagonal_mask_
from .nn import GroupedLinear, GroupedMLP, grouped_linear
from .profile import ProfileWarning

__version__ = "0.1.0"

__all__ = [
    "BlockDiagError",
    "BackendInfo",
    "Candidate",
    "GroupedLinear",
    "GroupedMLP",
    "Plan",
    "Problem",
    "ProfileWarning",
    "Settings",
    "__version__",
    "backends",
    "block_diag_bsr",
    "block_diag_coo",
    "block_diag_csr",
    "block_diag_dense",
    "block_diag_mask",
    "choose",
    "config",
    "from_scipy",
    "get_settings",
    "grouped_linear",
    "mask_block_diagonal_",
    "remove_block_diagonal_mask_",
    "set_config",
    "set_sparsity_threshold",
    "to_blocks",
    "to_scipy",
]


def backends() -> list[BackendInfo]:
    """The registered backends, each with whether it runs here and why not.

    >>> [b.name for b in blockdiag.backends()][:3]
    ['loop', 'dense', 'bmm']

    Returns:
        one :class:`BackendInfo` per registered backend, in registration order.
    """
    out = []
    for name in _names():
        b = _registry()[name]
        why = b.unavailable_reason()
        out.append(BackendInfo(name, why is None, why or "", b.summary))
    return out


def __getattr__(name: str):
    # ``blockdiag.distributed`` (group parallelism) loads torch.distributed.tensor, most of a
    # second, so ``import blockdiag`` does not import it: the first access does.
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
