"""blockdiag: many small independent linear layers as one fast block-diagonal operation.

Everything public is listed in ``__all__``; other modules may change without notice.

>>> import torch, blockdiag
>>> layer = blockdiag.GroupedLinear(4 * 150, 4 * 10, groups=4)
>>> layer(torch.randn(32, 600)).shape
torch.Size([32, 40])
"""

import sys as _sys
import types as _types
import warnings as _warnings

from ._errors import BlockDiagError
from .backends import Backend, Problem
from .backends._registry import BackendInfo
from .backends._registry import register as _register
from .backends._registry import registry as _registry
from .backends._registry import unregister as _unregister
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
from .nn.mlp import MLPPlan
from .profile import ProfileWarning

__version__ = "0.1.0"

__all__ = [
    "BlockDiagError",
    "Backend",
    "BackendInfo",
    "Candidate",
    "GroupedLinear",
    "GroupedMLP",
    "MLPPlan",
    "Plan",
    "Problem",
    "ProfileWarning",
    "Settings",
    "__version__",
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
    "list_backends",
    "mask_block_diagonal_",
    "register_backend",
    "remove_block_diagonal_mask_",
    "set_config",
    "set_sparsity_threshold",
    "to_blocks",
    "to_scipy",
    "unregister_backend",
]


def list_backends() -> list[BackendInfo]:
    """The registered backends, each with whether it runs here and why not.

    >>> [b.name for b in blockdiag.list_backends()][:3]
    ['loop', 'dense', 'bmm']

    Returns:
        one :class:`BackendInfo` per registered backend, in registration order.
    """
    out = []
    # A snapshot: a backend unregistered by another thread meanwhile is not looked up again.
    for name, b in tuple(_registry().items()):
        why = b.unavailable_reason()
        out.append(BackendInfo(name, why is None, why or "", b.summary))
    return out


def register_backend(backend: Backend) -> Backend:
    """Add a backend of your own: ``backend="<name>"`` runs it, and ``auto`` may choose it.

    The backend's ``fn(x, weight, bias) -> y`` takes a 2-D ``x [N, G*in]``, the weight
    ``[G, out, in]`` and the bias ``[G*out]`` or None, and returns ``y [N, G*out]``. Written
    in differentiable torch operations, it is used as it is: eagerly (autograd
    differentiates it), inside ``torch.compile`` / ``torch.export`` graphs (traced like any
    torch code) and under ``torch.func`` transforms. ``auto`` considers it where it accepts
    the problem (its ``dtypes``, ``grad`` and ``constraint``); with no measured times for it,
    it ranks after the measured backends (run ``blockdiag tune`` to measure it). Every plan
    cached before is stale from then on.

    >>> import torch, blockdiag
    >>> def einsum_fn(x, weight, bias):
    ...     g, o, i = weight.shape
    ...     y = torch.einsum("ngi,goi->ngo", x.view(-1, g, i), weight).reshape(-1, g * o)
    ...     return y if bias is None else y + bias
    >>> b = blockdiag.register_backend(blockdiag.Backend(
    ...     "einsum_doc", einsum_fn, dtypes={"cpu": frozenset({torch.float32})}))
    >>> b.name in [info.name for info in blockdiag.list_backends()]
    True
    >>> blockdiag.GroupedLinear(8, 6, groups=2, backend="einsum_doc")(torch.randn(3, 8)).shape
    torch.Size([3, 6])
    >>> _ = blockdiag.unregister_backend("einsum_doc")

    Args:
        backend: a :class:`Backend`: its name, function and the constraints under which it
            runs (device types and dtypes, whether it has a backward, shape rules).

    Returns:
        ``backend``, as registered.

    Raises:
        BlockDiagError: a backend of that name is already registered (the message names it;
            :func:`unregister_backend` it first), the name is ``"auto"`` or not a non-empty
            string, ``fn`` is not callable, ``same_forward_as`` names an unregistered backend, or
            a field is not of its documented kind (a flag that is not a bool, ``dtypes``,
            ``upcasts`` or ``reduced_precision`` not keyed by device type, ``requires`` not a
            module name, a ``constraint`` or ``probe`` that is not callable).
    """
    if not isinstance(backend, Backend):
        raise BlockDiagError(f"register_backend: expected a blockdiag.Backend, got {type(backend).__name__}")
    if not isinstance(backend.name, str) or not backend.name:
        raise BlockDiagError(f"register_backend: a backend's name must be a non-empty string, got {backend.name!r}")
    if not callable(backend.fn):
        raise BlockDiagError(f"register_backend: backend {backend.name!r}: fn must be callable, got {backend.fn!r}")
    return _register(backend)


def unregister_backend(name: str) -> Backend:
    """Remove the backend registered as ``name``; every plan cached before is stale.

    >>> blockdiag.unregister_backend("no_such_backend")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    blockdiag._errors.BlockDiagError: unregister: unknown backend 'no_such_backend'; valid names are ...

    Args:
        name: a registered backend's name (a built-in one too).

    Returns:
        the :class:`Backend` removed (pass it to :func:`register_backend` to restore it).

    Raises:
        BlockDiagError: unknown name (listing the valid ones), or another backend declares
            ``same_forward_as=name`` (remove that one first).
    """
    return _unregister(name)


class _BackendsModule(_types.ModuleType):
    """``blockdiag.backends``: the subpackage, still callable as the retired ``backends()``.

    ``blockdiag.backends()`` listed the backends before it was renamed
    :func:`list_backends`: a function of that name hid the subpackage
    (``import blockdiag.backends as B`` gave the function). The subpackage's class is this
    one, so the attribute is the subpackage and the old call still works, with a warning.
    """

    def __call__(self) -> list[BackendInfo]:
        _warnings.warn(
            "blockdiag.backends() is deprecated; use blockdiag.list_backends()", DeprecationWarning, stacklevel=2
        )
        return list_backends()


_sys.modules[__name__ + ".backends"].__class__ = _BackendsModule


def __getattr__(name: str):
    # ``blockdiag.distributed`` (group parallelism) loads torch.distributed.tensor, most of a
    # second, so ``import blockdiag`` does not import it: the first access does.
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
