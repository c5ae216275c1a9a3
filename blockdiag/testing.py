"""Helpers for tests and benchmarks: the plain references, tolerances, devices and dtypes."""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import torch
import torch.nn.functional as F

# Imported at run time, not only for type checkers: typing.get_type_hints (typeguard,
# beartype, jsonargparse) resolves the annotations that name it in this module's globals.
from .backends import Problem

__all__ = ["reference_loop", "reference_scipy", "tolerances", "backend_tolerances", "computes_in_tf32", "devices", "DTYPES_CPU"]

DTYPES_CPU = (torch.float32, torch.float64)


class Tolerances(TypedDict):
    """What :func:`tolerances` returns: ``assert_close(actual, expected, **tolerances(...))``.

    A TypedDict, so that a type checker matches its keys to ``assert_close``'s keywords.
    """

    atol: float
    rtol: float


def _check_operands(fn: str, x: object, weight: object, bias: object) -> None:
    """Refuse operands that are not tensors, or a weight that is not ``[G, out, in]``.

    The references index and detach them: anything else failed as an AttributeError or an
    unpacking ValueError from inside this module, naming no argument.
    """
    from ._errors import BlockDiagError

    for arg, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not (isinstance(t, torch.Tensor) or (arg == "bias" and t is None)):
            raise BlockDiagError(f"{fn}: {arg} must be a torch.Tensor{' or None' if arg == 'bias' else ''}, "
                                 f"got {type(t).__name__}")
    if weight.dim() != 3:
        raise BlockDiagError(f"{fn}: weight must be [groups, block_out, block_in], got shape {tuple(weight.shape)}")


def reference_loop(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The definition, one block at a time: ``y[..., g] = F.linear(x[..., g], weight[g], bias[g])``.

    >>> reference_loop(torch.ones(1, 4), torch.ones(2, 1, 2), None)
    tensor([[2., 2.]])
    """
    _check_operands("reference_loop", x, weight, bias)
    g, o, i = weight.shape
    outs = []
    for k in range(g):
        b = None if bias is None else bias[k * o:(k + 1) * o]
        outs.append(F.linear(x[..., k * i:(k + 1) * i], weight[k], b))
    return torch.cat(outs, dim=-1)


def reference_scipy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ scipy.linalg.block_diag(*weight).T + bias`` computed in float64 numpy.

    The result has ``x``'s dtype and device, as :func:`reference_loop`'s, so that it compares
    with a backend's output on any device.

    >>> reference_scipy(torch.ones(1, 4), torch.ones(2, 1, 2), None)
    tensor([[2., 2.]])

    Raises:
        ImportError: where SciPy (an optional dependency) is not installed or does not import.
    """
    from .construct import _import_scipy

    _check_operands("reference_scipy", x, weight, bias)
    linalg = _import_scipy("scipy.linalg", "reference_scipy", "pip install 'scipy>=1.10'; "
                           "reference_loop needs nothing more than torch")
    w = linalg.block_diag(*weight.detach().cpu().double().numpy())
    y = x.detach().cpu().double().numpy() @ w.T
    if bias is not None:
        y = y + bias.detach().cpu().double().numpy()
    return torch.from_numpy(np.ascontiguousarray(y)).to(device=x.device, dtype=x.dtype)


def tolerances(dtype: torch.dtype, k: int = 1, magnitude: float = 1.0) -> Tolerances:
    """``assert_close`` tolerances for a dtype, loosened for a reduction of length ``k``.

    ``magnitude`` (e.g. ``expected.abs().max()``) scales the absolute tolerance: a
    low-precision sum of terms of size ``m`` is off by a multiple of ``m``'s rounding step,
    however small the result, so near-zero entries of a gradient summed over a large batch
    need an absolute tolerance in units of ``m``. It scales both ways: results smaller than
    1 (a gradient of a mean, say) get a smaller absolute tolerance, or the dtype's unit one
    would pass them whatever they hold (zeros too).

    Neither tolerance exceeds a quarter of ``magnitude``, however long the reduction: looser,
    a result scaled by 2, or zeroed, would pass, and the check could not fail.

    >>> tolerances(torch.float64)["atol"] < tolerances(torch.float32)["atol"]
    True
    >>> tolerances(torch.bfloat16, magnitude=8.0)["atol"] == 8 * tolerances(torch.bfloat16)["atol"]
    True
    >>> tolerances(torch.bfloat16, magnitude=0.01)["atol"] == 0.01 * tolerances(torch.bfloat16)["atol"]
    True
    """
    from ._errors import BlockDiagError

    base = _TOLERANCES.get(dtype) if isinstance(dtype, torch.dtype) else None  # a list is unhashable
    if base is None:
        raise BlockDiagError(f"tolerances: dtype={dtype!r} has none; known: {', '.join(map(str, _TOLERANCES))}")
    # None or a str compared with 0 (or passed to float) raised a TypeError naming neither argument.
    try:
        k_ok = bool(k >= 0)
    except (TypeError, ValueError, RuntimeError):
        k_ok = False
    if not k_ok:
        raise BlockDiagError(f"tolerances: k={k!r} must be a reduction length >= 0")
    try:
        m = abs(float(magnitude))
    except (TypeError, ValueError, RuntimeError):
        raise BlockDiagError(
            f"tolerances: magnitude={magnitude!r} must be a real number (a result's largest size)") from None
    scale = max(1.0, k**0.5 / 4)
    # A NaN or Inf magnitude (an expected result holding one) would make atol NaN or Inf:
    # an Inf atol passes anything. The dtype's unit scale stands in.
    m = m if m < float("inf") else 1.0
    return {"atol": min(base[0] * scale, _LOOSEST) * m, "rtol": min(base[1] * scale, _LOOSEST)}


# (atol at magnitude 1, rtol) per dtype.
_TOLERANCES = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}
# The loosest either tolerance gets (atol in units of the magnitude). At 1/4 each, a result
# twice (or none) of the expected one fails at its largest entry: off by the magnitude there,
# it is allowed half of it.
_LOOSEST = 0.25


def _check_problem(fn: str, problem: object) -> None:
    """Refuse a ``problem`` that is not a :class:`~blockdiag.Problem` (its fields are read)."""
    from ._errors import BlockDiagError

    if not isinstance(problem, Problem):
        raise BlockDiagError(f"{fn}: problem must be a blockdiag.Problem, got {type(problem).__name__}")


def computes_in_tf32(name: str, problem: Problem) -> bool:
    """Whether backend ``name`` computes ``problem``'s float32 product in TF32 (on CUDA).

    torch's Triton BSR kernel always uses TF32 for float32, and cuDNN convolutions do while
    ``torch.backends.cudnn.allow_tf32`` is True (torch's default). TF32 keeps float16's
    10-bit mantissa.

    >>> from blockdiag.backends import Problem
    >>> computes_in_tf32("conv", Problem(8, 2, 4, 4))  # CPU: never
    False
    """
    from .backends.bsr import triton_applies

    _check_problem("computes_in_tf32", problem)
    return problem.device == "cuda" and problem.dtype == torch.float32 and (
        (name == "bsr" and triton_applies(problem))
        or (name == "conv" and torch.backends.cudnn.allow_tf32)
    )


def backend_tolerances(name: str, problem: Problem, k: int = 1, magnitude: float = 1.0) -> Tolerances:
    """:func:`tolerances` for ``problem.dtype``, or float16's where ``name`` computes it in TF32.

    >>> from blockdiag.backends import Problem
    >>> backend_tolerances("loop", Problem(8, 2, 4, 4)) == tolerances(torch.float32)
    True
    """
    _check_problem("backend_tolerances", problem)
    dtype = torch.float16 if computes_in_tf32(name, problem) else problem.dtype
    return tolerances(dtype, k, magnitude)


def devices() -> list[str]:
    """Device types present here: always ``"cpu"``, plus ``"cuda"`` when available."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
