"""``bmm`` and ``bmm_fm``: batched matmul on strided views, bias fused by ``baddbmm``.

Neither copies nor expands an operand: the input is read through a strided view and the
weight as stored (or through its transposed view); only the output is written once into
``[N, G*out]`` order. The two differ in which side the long batch dimension sits on:

* ``bmm`` computes ``[G, N, in] @ [G, in, out]`` (the weight as the transposed operand);
* ``bmm_fm`` ("feature-major") computes ``W [G, out, in] @ x^T [G, in, N]``, so each GEMM
  streams along the batch; on CPU it wins most small-block and training cases.

Which is faster depends on shape and mode, so both are registered and ``auto`` picks by the
measured table (``blockdiag tune``). In the built-in CPU table ``bmm`` itself is the fastest
at no point: ``simd`` wins 70 of the 83 forward points and ``bmm_fm`` the other 13 (most
256x256 points, and B=32 with 10x150 or 64x256 blocks), and, in training, ``simd`` (68),
``bmm_fm_bmm`` (``bmm_fm``'s forward with ``bmm``'s backward below; 8) and ``mkl_batch`` (4)
took the points ``bmm`` had (``bmm_fm`` itself wins one, B=32 G=16 10x150). On CUDA (the built-in H200 table) ``bmm`` wins
2 of 48 forward and 4 of 48 training points; it stays registered as the plainest batched
form.

``bmm`` has its own backward for one product. Autograd would form its weight gradient as
``x_g^T @ gy_g`` (``[G, in, out]``, the transposed weight's shape) and transpose it; the same
product as ``gy_g^T @ x_g`` gives ``[G, out, in]`` directly and, on CPU, was up to 18x faster
for that product alone (150x10 blocks, B=2048) and 1.0-2.6x faster for the whole training
step. ``bmm_fm``'s autograd backward already has that form, so it keeps autograd's.
"""

from __future__ import annotations

import torch

from .._errors import BlockDiagError
from ._registry import FLOATS, Backend, register


class _Bmm(torch.autograd.Function):
    # The backward is written in differentiable ops, so double backward works through it.
    @staticmethod
    def forward(ctx, x, weight, bias):
        g, o, i = weight.shape
        n = x.shape[0]
        xg = x.view(n, g, i).transpose(0, 1)  # [G, N, in], no copy
        if bias is None:
            y = torch.bmm(xg, weight.transpose(1, 2))
        else:
            y = torch.baddbmm(bias.view(g, 1, o), xg, weight.transpose(1, 2))
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y.transpose(0, 1).reshape(n, g * o)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        g, o, i = weight.shape
        n = x.shape[0]
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = gw = gb = None
        # Splitting one dimension is always a view, whatever gy's and x's strides.
        gyg = gy.view(n, g, o).transpose(0, 1)  # [G, N, out]
        if need_x:
            gx = torch.bmm(gyg, weight).transpose(0, 1).reshape(n, g * i)
        if need_w:
            gw = torch.bmm(gyg.transpose(1, 2), x.view(n, g, i).transpose(0, 1))
        if ctx.has_bias and need_b:
            gb = gy.sum(0)
        return gx, gw, gb


def bmm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y.view(N, G, out)[:, g] = x.view(N, G, in)[:, g] @ weight[g].T + bias.view(G, out)[g]``."""
    return _Bmm.apply(x, weight, bias)


def bmm_fm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y^T`` per group as ``weight[g] @ x_g^T + bias_g`` in ``[G, out, N]``, then one transpose."""
    g, o, i = weight.shape
    n = x.shape[0]
    xt = x.view(n, g, i).permute(1, 2, 0)  # [G, in, N], no copy
    if bias is None:
        yt = torch.bmm(weight, xt)
    else:
        yt = torch.baddbmm(bias.view(g, o, 1), weight, xt)
    return yt.permute(2, 0, 1).reshape(n, g * o)


def function_with(forward_fn, backward, name: str, backend_name: str | None = None) -> type:
    """An autograd Function with the forward ``forward_fn(x, weight, bias)`` and ``backward(ctx, gy)``.

    The forward saves ``(x, weight)`` themselves (not a kernel's copies, so a double backward
    reaches them) and sets ``ctx.has_bias``: what ``_Bmm.backward`` and ``loop``'s backward
    read.
    """

    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        if backend_name is not None:
            ctx.backend_name = backend_name
        return forward_fn(x, weight, bias)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def fm_forward_with(backward, name: str) -> type:
    """``bmm_fm``'s forward with the given backward: ``bmm_fm_bmm`` and ``bmm_fm_loop`` share it."""
    return function_with(bmm_fm, backward, name)


def compiled_function(forward_fn, first_order_backward, name: str, backend_name: str) -> type:
    """The autograd Function of a compiled-kernel backend (``mkl_batch``, ``simd``).

    ``first_order_backward(ctx, gy)`` runs the kernels. Under ``create_graph=True`` the
    backward is ``bmm``'s instead, written in differentiable ops, so double backward works
    (and ``auto``, which picks these backends for training, stays usable for gradient
    penalties).
    """

    def backward(ctx, gy):
        if torch.is_grad_enabled():
            return _Bmm.backward(ctx, gy)
        return first_order_backward(ctx, gy)

    return function_with(forward_fn, backward, name, backend_name)


BACKEND = register(
    Backend(
        name="bmm",
        fn=bmm,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="batched matmul, [G,N,in] @ weight^T views, bias fused (baddbmm)",
    )
)

BACKEND_FM = register(
    Backend(
        name="bmm_fm",
        fn=bmm_fm,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="batched matmul, feature-major weight @ x^T views, bias fused (baddbmm)",
    )
)


def call_compiled(name, check, hint, function, forward, x, weight, bias):
    """The shared entry of the backends that call compiled kernels (``mkl_batch``, ``simd``).

    Empty problems (a zero batch or block side) run ``bmm_fm``'s torch ops, which give the
    right empty or bias-only result and gradients; ``check()`` (the first call's numerical
    check) returning a reason raises :class:`BlockDiagError` naming the backend; without
    anything to differentiate the autograd ``function`` is skipped (its fixed cost is
    about 9 us), and ``forward`` runs directly.
    """
    if x.numel() == 0 or weight.numel() == 0:
        return bmm_fm(x, weight, bias)
    why = check()
    if why is not None:
        raise BlockDiagError(f"{name}: {why}; {hint}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return function.apply(x, weight, bias)
    return forward(x, weight, bias)
