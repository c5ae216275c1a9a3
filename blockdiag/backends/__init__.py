"""Backends: one module each, all registered in one string-keyed registry.

Importing this package registers the built-in backends. A backend's optional dependency is
imported only inside its kernel, so every module here imports without it.
"""

from . import loop, dense, bmm, bmm_fm_loop, bmm_fm_bmm, mkl_batch, simd, conv, csr, bsr  # noqa: F401, I001  (registration order)
from . import torch_sparse, grouped_mm  # noqa: F401, I001  (optional package / GPU feature)
from ._registry import Backend, BackendInfo, Problem, get, names, register, registry

__all__ = ["Backend", "BackendInfo", "Problem", "get", "names", "register", "registry"]
