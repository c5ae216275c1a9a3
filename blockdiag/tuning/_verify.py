"""Check each backend's numbers at a point before ``tune`` or ``bench`` times it.

A timing says which backend is fastest, not whether it is right. A registered backend with
a bug (a transposed block, a missing bias, a gradient of the wrong operand), or a kernel
library misbehaving on this machine, can be the fastest at a point; ``tune`` would write it
into the profile and ``auto`` would then run it everywhere the profile ranks it first,
silently. So each backend's result (and, in training, the gradients of the input, weight and
bias) is compared once with a float64 block-by-block product before it is timed, and a
wrong one is reported as skipped instead of timed.

The bound is the worst-case rounding error of a sum of ``k`` products in the working dtype
(``k * eps * sum |a_i b_i|``, Higham's gamma_k, with two units of slack for the bias and the
output's rounding, plus the smallest normal number per operation for underflow), entry by entry: any correct order of summation or blocking satisfies
it, so it never refuses a correct backend, and it catches what is wrong by more than
rounding (in float32 a 256-wide block allows about 3e-5 of the absolute product).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from .._errors import BlockDiagError
from ..backends import Problem
from ..backends._registry import check_result


def _blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, g = x.shape[0], w.shape[0]
    return x.reshape(n, g, w.shape[2])


def _excess(got: Optional[torch.Tensor], ref: torch.Tensor, mag: torch.Tensor, k: int, fi: torch.finfo) -> Optional[str]:
    """Why ``got`` is not ``ref`` up to rounding (``mag``: the sum of absolute products), or None."""
    if got is None:
        return "no gradient"
    if not isinstance(got, torch.Tensor) or got.layout != torch.strided:
        return f"a {type(got).__name__} of layout {getattr(got, 'layout', None)}, expected a strided tensor"
    if tuple(got.shape) != tuple(ref.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    err = (got.detach().to(torch.float64) - ref).abs()
    # Each operation may also lose up to the smallest normal number in absolute terms, where
    # it underflows (gradual underflow, or flushed to zero under torch.set_flush_denormal).
    bound = (k + 2) * (fi.eps * mag + fi.smallest_normal)
    # NaN compares False: a NaN where the reference is finite is an excess too.
    bad = ~(err <= bound) & torch.isfinite(ref)
    if not bool(bad.any()):
        return None
    idx = int(bad.reshape(-1).nonzero()[0])
    return (f"{int(bad.sum())} of {bad.numel()} entries beyond rounding (e.g. entry {idx}: "
            f"{got.reshape(-1)[idx].item():.6g}, expected {ref.reshape(-1)[idx].item():.6g})")


def _refused(name: str, fn: Callable, y, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
             grad: bool) -> Optional[str]:
    """Why the eager call would refuse what registered function ``fn`` returned, or None.

    The timer runs ``fn`` as it is, where every eager call and ``auto``'s op check its result
    (``blockdiag.backends._registry.check_result``): one of the wrong dtype, device or shape, an
    operand handed back, or one detached from the operands in training, is right in value
    (or compared as float64 here) yet refused at every call, so ``auto`` must not rank it.
    The built-in backends' ops are tested, and not checked per call.
    """
    from ..ops import OpEntry

    if isinstance(fn, OpEntry):
        return None
    try:
        check_result(name, y, x, w, b, grad)
    except BlockDiagError as e:
        return str(e)
    return None


def wrong_results(p: Problem, fns: Mapping[str, Callable], x: torch.Tensor, w: torch.Tensor,
                  b: torch.Tensor, gy: Optional[torch.Tensor]) -> dict[str, str]:
    """The entries of ``fns`` (name -> ``fn(x, weight, bias)``) whose result at ``p`` is wrong, each with why.

    ``x, w, b, gy`` are the point's inputs (``gy`` None for inference). A function that
    raises is left out of the answer: the timer runs it next and reports its error.

    >>> from blockdiag.backends import get
    >>> from blockdiag.tuning._timer import _inputs
    >>> p = Problem(batch=4, groups=2, block_in=3, block_out=5)
    >>> wrong = wrong_results(p, {"dense": get("dense").fn, "flipped": lambda x, w, b: -get("dense").fn(x, w, b)},
    ...                       *_inputs(p))
    >>> wrong["flipped"][:55], list(wrong)
    ('skipped: wrong result: 40 of 40 entries beyond rounding', ['flipped'])
    """
    fi = torch.finfo(x.dtype)
    x64, w64, b64 = (t.detach().to(torch.float64) for t in (x, w, b))
    xb = _blocks(x64, w64)
    n, g, o = x.shape[0], w.shape[0], w.shape[1]
    y_ref = (torch.einsum("ngi,goi->ngo", xb, w64).reshape(n, g * o) + b64)
    y_mag = torch.einsum("ngi,goi->ngo", xb.abs(), w64.abs()).reshape(n, g * o) + b64.abs()
    refs = None
    if gy is not None:
        gy64 = gy.to(torch.float64).reshape(n, g, o)
        refs = (
            ("input", torch.einsum("ngo,goi->ngi", gy64, w64).reshape(x.shape),
             torch.einsum("ngo,goi->ngi", gy64.abs(), w64.abs()).reshape(x.shape), o),
            ("weight", torch.einsum("ngo,ngi->goi", gy64, xb), torch.einsum("ngo,ngi->goi", gy64.abs(), xb.abs()), n),
            ("bias", gy64.sum(0).reshape(-1), gy64.abs().sum(0).reshape(-1), n),
        )
    out = {}
    for name, fn in fns.items():
        try:
            with torch.set_grad_enabled(gy is not None):
                y = fn(x, w, b)
                refused = _refused(name, fn, y, x, w, b, gy is not None)
                train = gy is not None and not refused
                grads = torch.autograd.grad(y, (x, w, b), gy, allow_unused=True) if train else ()
        except Exception:  # noqa: BLE001 - the timer runs it next and reports the error
            continue
        if refused:
            out[name] = f"skipped: {refused}"
            continue
        why = _excess(y, y_ref, y_mag, w.shape[2], fi)
        if why is not None:
            out[name] = f"skipped: wrong result: {why}"
            continue
        for (label, ref, mag, k), got in zip(refs or (), grads):
            why = _excess(got, ref, mag, k, fi)
            if why is not None:
                out[name] = f"skipped: wrong gradient of the {label}: {why}"
                break
    return out
