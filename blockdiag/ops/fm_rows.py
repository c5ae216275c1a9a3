"""``blockdiag::fm_rows``: a grouped product from a feature-major input into row-major output.

``GroupedMLP``'s chain keeps its hidden units feature-major, ``[G, in, N]``, and its last product
``y_g^T = W_g @ h_g + b_g`` gives ``[G, out, N]``, which the chain returns as the transposed view
``[N, G*out]``. In eager mode that view costs nothing: the caller's row-major gradient reaches
the backward's batched products as a strided view. In a traced training graph it does not:
AOTAutograd hands the backward a gradient with the strides the traced output had, so it copies
the caller's row-major gradient into a transposed layout on every step, and torch's copy into a
transposed destination is a slow element-wise loop (the opposite direction, ``.contiguous()``
of a transposed view, takes a blocked path). This op is the same product with the batched GEMM
writing a new row-major ``[N, G*out]`` directly (``out=`` its ``[G, out, N]`` strided view, as
``bmm_fm``'s ``rows`` kernel does), so the traced output, and the gradient the backward is
handed, are row-major. Its backward reads that gradient through a strided view as eager does.

The op is opaque to the compiler (a GEMM written through a strided ``out=`` cannot be expressed
in traced torch ops without the copy); its backward is differentiable torch ops, which the
compiler traces and fuses, and which double backward differentiates again.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad as _fwad

from ._define import (
    LIB,
    _jvp,
    _named,
    _records,
    forward_ad_active,
    kept_for_backward,
    kept_weight_for_backward,
    register_autocast,
    saved_operands,
)

__all__ = ["fm_rows", "fm_rows_backward", "write_rows"]

LIB.define("fm_rows(Tensor h, Tensor weight, Tensor? bias) -> Tensor")
FORWARD = torch.ops.blockdiag.fm_rows.default


def write_rows(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of a feature-major ``h [G, in, N]`` written into a new row-major ``[N, G*out]``.

    The kernel of this op and of the feature-major backends' ``OpEntry.rows``.
    """
    g, o, _ = weight.shape
    n = h.shape[2]
    y = h.new_empty(n, g * o)
    yt = y.view(n, g, o).permute(1, 2, 0)  # [G, out, N]: each block a transposed matrix, ld G*out
    if bias is None:
        torch.bmm(weight, h, out=yt)
    else:
        torch.baddbmm(bias.view(g, o, 1), weight, h, out=yt)
    return y


def _fake(h, weight, bias):
    g, o, _ = weight.shape
    return h.new_empty(h.shape[2], g * o)


def fm_rows_backward(gy, h, weight, need_h, need_w, need_b):
    """The gradients of ``h``, weight and bias in differentiable torch ops (None where not asked for).

    Traced into compiled backward graphs; also ``bmm_fm``'s backward, whose input is ``h`` seen
    as rows.
    """
    g, o, _ = weight.shape
    n = h.shape[2]
    gyt = gy.reshape(n, g, o).permute(1, 2, 0)  # [G, out, N], a view of a row-major gradient
    gh = torch.bmm(weight.transpose(1, 2), gyt) if need_h else None
    gw = torch.bmm(gyt, h.transpose(1, 2)) if need_w else None
    gb = gy.sum(0) if need_b else None
    return gh, gw, gb


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, keyset):
        ctx.save_for_backward(kept_for_backward(ctx, h), kept_weight_for_backward(ctx, weight))
        ctx.save_for_forward(h, weight)
        if _fwad._current_level >= 0:  # no zero tangent for an operand without one (_define._setup)
            ctx.set_materialize_grads(False)
        with torch._C._AutoDispatchBelowAutograd():
            return FORWARD.redispatch(keyset & torch._C._after_autograd_keyset, h, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        if gy is None:
            return None, None, None, None
        h, weight = saved_operands(ctx)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        return (*fm_rows_backward(gy, h, weight, need_h, need_w, need_b), None)

    @staticmethod
    def jvp(ctx, th, tw, tb, _keyset):
        return _jvp(fm_rows, ctx, th, tw, tb, rows_dim=2)


_Fn = _named(_Fn, "fm_rows_Op")


def _torch_ops(h, weight, bias):
    """The product in differentiable torch ops: what a ``torch.func`` transform reaching the op
    runs (see ``_define.transform_forward``); a transposed view, not written into rows."""
    g, o, _ = weight.shape
    yt = torch.bmm(weight, h) if bias is None else torch.baddbmm(bias.view(g, o, 1), weight, h)
    return yt.permute(2, 0, 1).reshape(h.shape[2], g * o)


def _autograd_kernel(keyset, h, weight, bias):
    if torch._C._are_functorch_transforms_active():
        return _torch_ops(h, weight, bias)
    if _records(h, weight, bias) or forward_ad_active(h, weight, bias):
        return _Fn.apply(h, weight, bias, keyset)
    return FORWARD.redispatch(keyset & torch._C._after_autograd_keyset, h, weight, bias)


def _vmap(info, in_dims, h, weight, bias):
    # Each vmapped copy becomes more groups of one product: [B, G, ...] -> [B*G, ...].
    hd, wd, bd = in_dims
    nb = info.batch_size
    hb = h.movedim(hd, 0) if hd is not None else h.expand(nb, *h.shape)
    wb = weight.movedim(wd, 0) if wd is not None else weight.expand(nb, *weight.shape)
    g, o, i = wb.shape[1:]
    bb = None
    if bias is not None:
        bb = (bias.movedim(bd, 0) if bd is not None else bias.expand(nb, *bias.shape)).reshape(-1)
    y = FORWARD(hb.reshape(nb * g, i, hb.shape[-1]), wb.reshape(nb * g, o, i), bb)
    return y.view(y.shape[0], nb, g * o), 1


def _flops(h_shape, w_shape, *args, **kwargs) -> int:
    g, o, i = w_shape
    return 2 * h_shape[2] * g * i * o


LIB.impl("fm_rows", write_rows, "CompositeExplicitAutograd")
torch.library.register_fake("blockdiag::fm_rows", _fake, lib=LIB)
LIB.impl("fm_rows", _autograd_kernel, "Autograd", with_keyset=True)
torch.library.register_vmap("blockdiag::fm_rows", _vmap, lib=LIB)
register_autocast("fm_rows", FORWARD)


def _register_flops() -> None:
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(FORWARD.overloadpacket)(_flops)


_register_flops()


def fm_rows(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y[:, g-th block] = (weight[g] @ h[g] + bias_g)^T``, as a new row-major ``[N, G*out]``.

    >>> h, w = torch.randn(3, 4, 5), torch.randn(3, 2, 4)
    >>> y = fm_rows(h, w, None)
    >>> y.shape, y.is_contiguous()
    (torch.Size([5, 6]), True)

    Args:
        h: the feature-major input ``[G, in, N]``.
        weight: ``[G, out, in]``.
        bias: ``[G*out]`` or None.

    Returns:
        ``[N, G*out]``, row-major.
    """
    return FORWARD(h, weight, bias)
