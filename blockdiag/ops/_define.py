"""How a backend becomes a registered torch operator: one forward op and one backward op each.

For a backend ``name`` this module defines, in the ``blockdiag`` op namespace:

* ``blockdiag::<name>(Tensor x, Tensor weight, Tensor? bias) -> Tensor``, the forward product
  of a 2-D ``x [N, G*in]``;
* ``blockdiag::<name>_backward(Tensor grad, Tensor x, Tensor weight, bool has_bias,
  bool need_input, bool need_weight) -> (Tensor, Tensor, Tensor)``, the first-order
  gradients of input, weight and bias (one not asked for comes back with 0 elements).

Each has a fake kernel (exact shape, dtype, device and strides, no data access), so
FakeTensor, meta, ``torch.compile`` and ``torch.export`` never reach a kernel; the forward op
has its autograd (an ``autograd.Function`` with ``setup_context``, a ``jvp`` and a vmap rule)
registered at the op's Autograd key, a batching rule (the vmapped copies become more groups of
one product) and FLOP formulas for :class:`~torch.utils.flop_counter.FlopCounterMode`.

Three routes reach a backend (:class:`OpEntry`):

* eager on plain tensors (no tracing, transform, dispatch mode, tensor subclass, forward AD or
  profiler): the kernel is called directly, inside the same ``autograd.Function`` when
  autograd records. The dispatcher round trip of a Python op costs about as much as a small
  product, and there is nothing for it to do here;
* under a ``torch.func`` transform: a Python-level ``autograd.Function`` whose forward calls the
  op (``torch.func`` cannot enter a Python autograd kernel from inside the dispatcher);
* everything else (compile, export, ``jit.trace``, FakeTensor, meta, DTensor, forward AD,
  profiler, dispatch modes): the registered op.

The backward: the backend's own first-order kernels through its backward op; under
``create_graph=True`` (double backward), a ``torch.func`` transform, or a forward-mode tangent
on the gradient or an operand (forward-over-reverse), the batched-matmul formulas written in
differentiable torch ops, for double backward only where the backend declares ``double_grad``
(a first-order backend refuses double backward with :class:`BlockDiagError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.autograd import forward_ad as _fwad

from .._checks import check_same_device_dtype
from .._errors import BlockDiagError

__all__ = ["LIB", "OpEntry", "check_backward_operands", "check_operands", "define", "differentiable_backward_needed", "entries", "fake_rows", "forward_op", "backward_op", "plain_eager", "generic_backward", "saved_operands", "saved_tensors_hooked", "validate_operands"]

LIB = torch.library.Library("blockdiag", "DEF")

FORWARD_SCHEMA = "(Tensor x, Tensor weight, Tensor? bias) -> Tensor"
BACKWARD_SCHEMA = (
    "(Tensor grad, Tensor x, Tensor weight, bool has_bias, bool need_input, bool need_weight) "
    "-> (Tensor, Tensor, Tensor)"
)

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# What a traced graph's operands are while dynamo and AOTAutograd trace (both modules are
# loaded by ``import torch`` itself): see kept_for_backward.
_KEEPABLE = frozenset((*_PLAIN, FakeTensor, FunctionalTensor))
_ENTRIES: dict[str, "OpEntry"] = {}

# fn(x [N, G*in], weight [G, out, in], bias [G*out] | None) -> y [N, G*out]
Forward = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
# fn(grad, x, weight, has_bias, need_input, need_weight) -> (gx | None, gw | None, gb | None)
Backward = Callable[..., tuple]


_STRIDED = torch.strided


def plain_eager(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether a call may skip the dispatcher: plain eager tensors and nothing that observes ops.

    Anything else (tracing, compile, export, a ``torch.func`` transform, a dispatch mode such as
    FakeTensorMode or FlopCounterMode, forward AD, the profiler, a subclass such as DTensor,
    the meta device) goes through the registered op, which every one of those understands.
    """
    # is_compiling() first: dynamo folds it to a constant, so it never traces the rest.
    return (
        not torch.compiler.is_compiling()
        and type(x) in _PLAIN
        and type(weight) in _PLAIN
        and (bias is None or (type(bias) in _PLAIN and bias.layout is _STRIDED))
        # The per-call plan cache keys on shapes, so a sparse operand of a cached shape must
        # not take this path: the op path checks it and names it.
        and x.layout is _STRIDED
        and weight.layout is _STRIDED
        and not x.is_meta
        and _fwad._current_level < 0
        and not torch._C._are_functorch_transforms_active()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch.autograd.profiler._is_profiler_enabled
        and torch._C._get_tracing_state() is None
    )


def functorch_function_route() -> bool:
    """Whether an eager call runs the op's ``torch.func`` Function (a transform is in force).

    Not while dynamo traces (see :meth:`OpEntry.call_op`), and not under
    ``torch.func.functionalize``: functorch has no functionalize rule for an autograd
    Function ("NYI: Functionalize rule for custom_function_call"), also where another
    transform inside it runs the Function's forward at its level. The op itself is
    functional, so it is called there; its autograd kernel runs the product as torch ops
    (:func:`transform_forward`), which every transform differentiates and batches itself.
    """
    if not torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return False
    stack = torch._C._functorch.get_interpreter_stack() or ()
    return all(i.key() != torch._C._functorch.TransformType.Functionalize for i in stack)


def forward_ad_active(*tensors) -> bool:
    """Whether forward-mode AD may see a call on ``tensors``: a level entered from Python, or a tangent.

    A graph compiled by ``torch.compile`` enters its dual level in C
    (``torch._functorch.predispatch``), which ``forward_ad._current_level`` does not see, so
    the operands are asked too. torch has no nested forward AD: a tangent is at level 0.
    """
    if _fwad._current_level >= 0:
        return True
    unpack = torch._C._VariableFunctions._unpack_dual
    return any(t is not None and unpack(t, 0).tangent is not None for t in tensors)


_TOP_SAVED_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saved_tensors_hooked() -> bool:
    """Whether ``saved_tensors_hooks`` are in force (a non-reentrant checkpoint, an offload).

    There an ``eager_autograd`` backend runs in its autograd Function, as the op does, not
    as its torch ops. ``checkpoint(use_reentrant=False)`` matches the tensors the forward
    saved with those its recomputation saves, one by one, and the op (taken under a
    profiler or a dispatch mode such as ``FlopCounterMode``) saves the input and the weight
    where the torch ops save their own operands (``bmm_fm``: a transposed input; ``conv``:
    3-d views): a profiler or mode around only one of the two passes failed the backward
    with ``CheckpointError``. Without torch's query (private API), as if hooks were in force.
    """
    return _TOP_SAVED_HOOKS is None or _TOP_SAVED_HOOKS(False) is not None


def _records(x, weight, bias) -> bool:
    return torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )


def generic_backward(gy, x, weight, has_bias, need_x, need_w, need_b):
    """The gradients in differentiable torch ops (batched matmul on strided views).

    ``gx_g = gy_g @ W_g``, ``gW_g = gy_g^T @ x_g``, ``gb = sum(gy)``: what double backward and
    ``torch.func`` transforms differentiate through.
    """
    g, o, i = weight.shape
    n = x.shape[0]
    gyg = gy.reshape(n, g, o).transpose(0, 1)  # [G, N, out]
    gx = gw = gb = None
    if need_x:
        gx = torch.bmm(gyg, weight).transpose(0, 1).reshape(n, g * i)
    if need_w:
        gw = torch.bmm(gyg.transpose(1, 2), x.reshape(n, g, i).transpose(0, 1))
    if has_bias and need_b:
        gb = gy.sum(0)
    return gx, gw, gb


def fake_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The fake kernel of a product written into a new row-major ``[N, G*out]``."""
    g, o, _ = weight.shape
    return x.new_empty(x.shape[0], g * o)


# A row-major result written through a strided ``out=`` view (``OpEntry.rows``) takes each
# group's rows as runs of ``out`` (or ``in``) elements, ``G*out`` apart. A run shorter than a
# cache line writes lines partly, and the product written contiguous then copied is faster;
# scripts/bench_rows.py times the two on the machine it runs on.
ROWS_MIN_RUN_BYTES = 64


def rows_pay(run: int, dtype: torch.dtype) -> bool:
    """Whether writing runs of ``run`` elements of ``dtype`` through a strided view pays (see above)."""
    return run * dtype.itemsize >= ROWS_MIN_RUN_BYTES


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


@dataclass(eq=False)
class OpEntry:
    """A backend's kernels and the ops registered for them; calling it runs the product.

    Attributes:
        name: the backend (and op) name.
        forward: the forward kernel on a 2-D input, no autograd.
        backward: the first-order gradient kernel, no autograd; None: :func:`generic_backward`.
        fake: the fake kernel of the forward op; None: ``forward`` itself when ``traceable``
            (torch ops only: it then gives exactly the strides the kernel gives), else a
            contiguous ``[N, G*out]`` (the op then returns a contiguous result).
        traceable: ``forward`` uses torch ops only, so it runs on FakeTensor and meta inputs.
        native: the kernels hand data pointers to C: the op refuses anything but plain
            strided CPU tensors before they run, and the kernels check each operand's
            storage where they take its pointer.
        check: ``check(x, weight, bias)`` returns why the kernels cannot run these operands
            (e.g. a failed self-check), or None; run by the op before the kernel.
        eager_autograd: ``backward`` computes what torch's own derivatives of ``forward``
            compute, in the same products: eager calls then record ``forward``'s torch ops
            under autograd directly, without the Python Function (whose fixed cost is about
            as large as a small product), except under saved-tensor hooks
            (:func:`saved_tensors_hooked`); the ops still use ``backward``.
        traceable_backward: ``backward`` is torch ops without ``out=`` or in-place writes,
            so a compiler can take it as it is (see :attr:`inlinable`).
        rows: for a backend whose ``forward`` returns a transposed view of ``[N, G*out]``,
            the same product written straight into a new row-major ``[N, G*out]``: what a
            caller that must return a contiguous result runs where :func:`rows_pay` says
            (the ``auto`` op), instead of the forward and a transposing copy.
        rows_input_grad: ``rows_input_grad(gy, weight)``, the input gradient written straight
            into a new row-major ``[N, G*in]``, where the backward forms it in another order
            and copies it; used with ``rows``.
        compiled_ops: ``compiled_ops()`` gives ``{dtype: ops}``, the C++ torch ops
            (``ops.forward(x, weight, bias)``, ``ops.backward(gy, x, weight, has_bias,
            need_x, need_w)``) that run the kernels with no Python per call, for each dtype
            they are ready for now; a graph ``torch.compile`` traces at a static batch
            records them where ``auto`` chooses this backend (see ``blockdiag.ops.auto``).
        forward_copies: ``forward_copies(x, weight, bias)``, the products of ``B`` copies of
            the weight: ``x [B or 1, N, G*in]``, ``weight [B, G, out, in]``, ``bias
            [B, G*out]`` or None, giving ``[B, N, G*out]``; the batching rule runs it for a
            vmapped weight or bias where folding the copies into ``B*G`` groups of one product
            costs more than ``B`` products (``dense``: one ``[B*G*out, B*G*in]`` matrix, ``B``
            times the memory and FLOPs of the copies' matrices). None: the copies are groups.
        prepare_ops: ``prepare_ops(dtype, device_type)`` makes ``compiled_ops`` ready for
            ``dtype`` on that device type where they can be (what the backend's first eager
            call does), and never raises; called when a graph is traced, before it reads
            which routes are ready.
    """

    name: str
    forward: Forward
    backward: Optional[Backward] = None
    fake: Optional[Forward] = None
    traceable: bool = False
    native: bool = False
    check: Optional[Callable] = None
    eager_autograd: bool = False
    traceable_backward: bool = False
    rows: Optional[Forward] = None
    rows_input_grad: Optional[Callable] = None
    compiled_ops: Optional[Callable[[], dict]] = None
    prepare_ops: Optional[Callable[[torch.dtype, str], None]] = None
    forward_copies: Optional[Callable] = None

    @property
    def inlinable(self) -> bool:
        """Whether a traced graph may record this backend's eager route instead of its op.

        Its forward is torch ops, and so is its backward: torch's own derivatives
        (``eager_autograd``), :func:`generic_backward` (``backward`` None) or a backward
        declared ``traceable_backward``. A backward writing into slices (``loop``'s) would be
        rewritten by functionalization into copies, so such a backend stays one opaque op.
        """
        return self.traceable and (self.eager_autograd or self.backward is None or self.traceable_backward)

    def __post_init__(self) -> None:
        self.fwd_op = None
        self.bwd_op = None
        self._eager_fn = None
        self._op_fn = None
        self._py_fn = None

    def run_check(self, x, weight, bias) -> None:
        """Raise :class:`BlockDiagError` when ``check`` says the kernels cannot run these operands.

        Before every kernel call, forward or backward: a backward op can be the first call
        in a dtype (``auto`` plans its backward for training, its forward perhaps not; the
        backward op is public), and the native backends' self-checks run in ``check``.
        """
        if self.check is not None:
            why = self.check(x, weight, bias)
            if why is not None:
                raise BlockDiagError(f"{self.name}: {why}")

    # The routes -------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if plain_eager(x, weight, bias):
            return self.eager(x, weight, bias)
        return self.call_op(x, weight, bias)

    def eager(self, x, weight, bias):
        """The kernel called directly (plain eager tensors): in the autograd Function if recording."""
        self.run_check(x, weight, bias)
        if _records(x, weight, bias) and (not self.eager_autograd or saved_tensors_hooked()):
            return self._eager_fn.apply(x, weight, bias)
        return self.forward(x, weight, bias)

    def call_op(self, x, weight, bias):
        """The registered op (or, under a ``torch.func`` transform, the Function around it).

        Not while dynamo traces: it cannot trace a Function with a custom ``jvp`` and breaks
        the graph, and a break inside a traced ``vmap`` ran the kernel on garbage. The op
        itself has a vmap rule, and under a traced transform its autograd kernel runs the
        product as torch ops (:func:`transform_forward`). Not under ``functionalize`` either
        (see :func:`functorch_function_route`).
        """
        if functorch_function_route():
            return self._py_fn.apply(x, weight, bias)
        return self.fwd_op(x, weight, bias)

    # The kernels behind the ops ---------------------------------------------------------
    def _guard(self, *named: tuple[str, Optional[torch.Tensor]]) -> None:
        # The op's refusal, before a self-check or kernel runs. Whether the storage holds the
        # view is checked where each pointer is taken (backends._native.check_stored, which
        # also bounds the extent): here it would build a storage object per operand per call.
        if not self.native:
            return
        for arg, t in named:
            if t is not None and (type(t) not in _PLAIN or not t.is_cpu or t.layout is not _STRIDED):
                raise BlockDiagError(
                    f"{self.name}: {arg} must be a plain strided CPU tensor for the compiled kernels, got "
                    f"{type(t).__name__} on {t.device} with layout {t.layout}"
                )

    def _impl(self, x, weight, bias):
        self._guard(("input", x), ("weight", weight), ("bias", bias))
        _validate(self.name, x, weight, bias)
        self.run_check(x, weight, bias)
        y = self.forward(x, weight, bias)
        return y if self.traceable and self.fake is None else _contiguous(y)

    def _fake(self, x, weight, bias):
        if self.fake is not None:
            return self.fake(x, weight, bias)
        if self.traceable:
            return self.forward(x, weight, bias)
        g, o, _ = weight.shape
        return x.new_empty(x.shape[0], g * o)

    def run_backward(self, gy, x, weight, has_bias, need_x, need_w):
        """The first-order kernels (or :func:`generic_backward` when the backend has none)."""
        if self.backward is None:
            return generic_backward(gy, x, weight, has_bias, need_x, need_w, True)
        return self.backward(gy, x, weight, has_bias, need_x, need_w)

    def _bwd_impl(self, gy, x, weight, has_bias, need_x, need_w):
        self._guard(("grad", gy), ("input", x), ("weight", weight))
        check_backward_operands(f"{self.name}_backward", gy, x, weight)
        self.run_check(x, weight, None)
        gx, gw, gb = self.run_backward(gy, x, weight, has_bias, need_x, need_w)
        return _placeholders(gy, x, weight, has_bias, gx, gw, gb)

    def _bwd_fake(self, gy, x, weight, has_bias, need_x, need_w):
        return fake_backward(gy, x, weight, has_bias, need_x, need_w)


def fake_backward(gy, x, weight, has_bias, need_x, need_w):
    """The fake kernel of a backward op: each gradient's shape, or 0 elements where not asked for."""
    g, o, i = weight.shape
    return (
        gy.new_empty(x.shape) if need_x else gy.new_empty(0),
        gy.new_empty(g, o, i) if need_w else gy.new_empty(0),
        gy.new_empty(g * o) if has_bias else gy.new_empty(0),
    )


def _placeholders(gy, x, weight, has_bias, gx, gw, gb):
    # An op cannot return None: a gradient not asked for is an empty tensor.
    return (
        gy.new_empty(0) if gx is None else _contiguous(gx),
        gy.new_empty(0) if gw is None else _contiguous(gw),
        gy.new_empty(0) if gb is None else _contiguous(gb),
    )


_VALID: dict = {}


def _check_input_fits(name: str, x, weight) -> tuple[int, int, int]:
    """Raise :class:`BlockDiagError` unless ``weight`` is ``[G >= 1, out, in]`` and ``x`` is ``[N, G*in]``; ``(G, out, in)``."""
    if weight.dim() != 3:
        raise BlockDiagError(f"{name}: weight must be [groups, block_out, block_in], got shape {tuple(weight.shape)}")
    g, o, i = weight.shape
    if g < 1:
        raise BlockDiagError(f"{name}: weight must hold at least one group, got shape {tuple(weight.shape)} (groups=0)")
    if x.dim() != 2 or x.shape[1] != g * i:
        raise BlockDiagError(f"{name}: input must be [N, {g * i}] for weight {tuple(weight.shape)}, got {tuple(x.shape)}")
    return g, o, i


def check_operands(name: str, x, weight, bias) -> tuple[int, int, int]:
    """Raise :class:`BlockDiagError` unless the forward op's operands fit each other; ``(G, out, in)``.

    The layers check their operands before they call an op, but the op is public
    (``torch.ops.blockdiag.<name>``) and its kernels index the bias and the input by the
    weight's shape: a bias of another length or dtype was read in part, broadcast or
    promoted by whatever torch op a backend ends in, or refused by it in its own words.
    """
    g, o, i = _check_input_fits(name, x, weight)
    if bias is not None and tuple(bias.shape) != (g * o,):
        raise BlockDiagError(f"{name}: bias must have shape ({g * o},) for weight {tuple(weight.shape)}, got {tuple(bias.shape)}")
    check_same_device_dtype(name, input=x, weight=weight, bias=bias)
    return g, o, i


def check_backward_operands(name: str, gy, x, weight) -> None:
    """Raise :class:`BlockDiagError` unless the backward op's gradient, input and weight fit each other.

    The kernels take the row count from ``x`` and read as many rows of the gradient: a
    gradient with fewer rows than ``x`` (a slice of a larger tensor) was read past its end.
    """
    ws, xs = weight.shape, x.shape
    # Per backward call (not cached: the gradient's shape is not the forward's key), so the
    # common case is a few comparisons; the messages are built only when one fails.
    if (len(ws) == 3 and len(xs) == 2 and xs[1] == ws[0] * ws[2] and gy.shape == (xs[0], ws[0] * ws[1])
            and gy.dtype == x.dtype == weight.dtype and gy.device == x.device == weight.device):
        return
    g, o, i = _check_input_fits(name, x, weight)
    if gy.dim() != 2 or tuple(gy.shape) != (x.shape[0], g * o):
        raise BlockDiagError(
            f"{name}: grad must be [N, {g * o}] with the input's N={x.shape[0]} rows, got {tuple(gy.shape)}"
        )
    check_same_device_dtype(name, input=x, grad=gy, weight=weight)


def _key(name: str, x, weight, bias) -> tuple:
    # Everything check_operands reads: the operands' shapes, dtypes and devices.
    return (name, x.shape, weight.shape, x.dtype, x.device, weight.dtype, weight.device,
            None if bias is None else (bias.shape, bias.dtype, bias.device), torch.is_grad_enabled())


def validate_operands(name: str, x, weight, bias) -> None:
    """:func:`check_operands`, cached by the operands' shapes, dtypes and devices."""
    key = _key(name, x, weight, bias)
    if key in _VALID:
        return
    check_operands(name, x, weight, bias)
    if len(_VALID) > 4096:
        _VALID.clear()
    _VALID[key] = True


def _validate(name: str, x, weight, bias) -> None:
    """Raise :class:`BlockDiagError` when backend ``name`` declines these operands (cached)."""
    from ..backends import Problem, get

    key = _key(name, x, weight, bias)
    if key in _VALID:
        return
    g, o, i = check_operands(name, x, weight, bias)
    p = Problem(x.shape[0], g, i, o, x.dtype, x.device.type, False)
    why = get(name).decline_reason(p)
    if why is not None:
        raise BlockDiagError(f"{name}: cannot run {p.describe()}: {why}")
    if len(_VALID) > 4096:
        _VALID.clear()
    _VALID[key] = True


def differentiable_backward_needed(gy: torch.Tensor, x: Optional[torch.Tensor] = None,
                                   weight: Optional[torch.Tensor] = None) -> bool:
    """Whether a backward must be written in differentiable torch ops rather than run the kernels.

    Under ``create_graph=True`` (grad mode is on in the backward), under a ``torch.func``
    transform, for batched gradients (``autograd.grad(..., is_grads_batched=True)``, whose
    vmap hands the backward a batched tensor without a functorch transform in force), and
    inside a forward-mode dual level where the gradient or a saved operand (``x``,
    ``weight``) carries a tangent (forward-over-reverse: the tangent of the gradient is a
    Hessian-vector product): the kernels see plain tensors only, so their results would not
    be differentiable, and would drop the tangent (or, written with ``out=``, raise).
    """
    return (
        torch.is_grad_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch._C._functorch.is_batchedtensor(gy)
        # Dynamo cannot trace this builtin (compiled autograd traces this backward), and
        # no legacy-batched tensor reaches a traced graph: vmap's are functorch's there.
        or (not torch.compiler.is_compiling() and torch._C._functorch.is_legacy_batchedtensor(gy))
        # The level first: outside a dual level (every ordinary backward) nothing is unpacked.
        or (_fwad._current_level >= 0 and forward_ad_active(gy, x, weight))
    )


def _differentiable_backward(name: str, ctx, gy, x, weight):
    """Double backward, a ``torch.func`` transform or forward-over-reverse: the gradients in differentiable ops."""
    from ..backends import get

    # Only a true double backward needs the declaration: torch.func and batched gradients
    # differentiate the first-order formula once, which every backend's values support. A
    # product recorded under a torch.func transform is differentiated by torch.func, whose
    # vjp pullback (and jacrev with chunk_size=1, which calls it) runs after its transform
    # has exited, with create_graph=True wherever grad mode is on: a first-order request.
    if (torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
            and not getattr(ctx, "func_transform", False) and not get(name).double_grad):
        from ..backends._registry import double_grad_hint

        raise BlockDiagError(
            f"{name}: the backward is first-order only and cannot be differentiated again "
            f"(create_graph=True); {double_grad_hint(gy.device.type)}"
        )
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    return generic_backward(gy, x, weight, ctx.has_bias, need_x, need_w, need_b)


def _jvp(entry_call, ctx, tx, tw, tb, rows_dim: int = 0):
    """The product is linear in each operand: ``d(x W^T + b) = dx W^T + x dW^T + db``.

    ``rows_dim`` is the saved input's dimension that indexes the output's rows (0 for
    ``[N, G*in]``, 2 for the feature-major ``[G, in, N]`` of ``blockdiag::fm_rows``).
    """
    x, weight = ctx.saved_tensors
    n = x.shape[rows_dim]
    out = None
    if tx is not None:
        out = entry_call(tx, weight, None)
    if tw is not None:
        t = entry_call(x, tw, tb)
        out = t if out is None else out + t
    elif tb is not None:
        out = tb.expand(n, tb.shape[0]) if out is None else out + tb
    if out is None:
        out = x.new_zeros(n, weight.shape[0] * weight.shape[1])
    return out


def kept_for_backward(ctx, x: torch.Tensor) -> torch.Tensor:
    """``x`` where the backward needs it, else a one-row stand-in: :func:`saved_operands` expands it.

    Only the weight gradient reads the input's values. Saved regardless, a frozen layer's
    input (the activation) lived until the backward, where ``nn.Linear`` frees it as soon as
    the next layer is done with it. Expanded, the stand-in has ``x``'s shape, dtype and
    device (the kernels read ``n`` from it) and a unit column stride, so every kernel takes
    it as it would ``x``. It is saved one row, unexpanded, with ``x``'s shape on ``ctx``: a
    saved-tensors hook that copies what it is given (``save_on_cpu`` does
    ``torch.empty(t.size()).copy_(t)``) made the expanded one a buffer of the input's size.

    Plain tensors, and the fake and functional tensors that ``torch.compile`` and
    ``torch.export`` trace with: there the stand-in is a traced op on the symbolic shape,
    so a compiled backward takes a one-row tensor (or rebuilds it), not the activation. Not
    under a ``torch.func`` transform, nor for another subclass: DTensor carries placements
    that a stand-in would not have, and a user's subclass may carry anything.
    """
    if ctx.needs_input_grad[1] or type(x) not in _KEEPABLE or torch._C._are_functorch_transforms_active():
        ctx.stand_in_shape = None
        return x
    ctx.stand_in_shape = x.shape
    return x.new_zeros((1,) * (x.dim() - 1) + x.shape[-1:])


def saved_operands(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and weight saved with :func:`kept_for_backward` and :func:`kept_weight_for_backward`,
    the stand-ins expanded to the operands' shapes."""
    x, weight = ctx.saved_tensors
    if ctx.stand_in_shape is not None:
        x = x.expand(ctx.stand_in_shape)
    if getattr(ctx, "weight_stand_in_shape", None) is not None:
        weight = weight.expand(ctx.weight_stand_in_shape)
    return x, weight


def kept_weight_for_backward(ctx, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` where the backward needs it, else a stand-in of its shape that holds one value.

    Only the input gradient reads the weight's values. Saved regardless, a layer whose input
    needs no gradient (a first layer, heads on frozen features) kept its weight in the graph,
    where ``nn.Linear`` does not: an in-place change of the weight before the backward (a
    step between two losses' backwards) raised autograd's "modified by an inplace operation",
    and ``.to()``, ``.double()`` or ``load_state_dict`` under
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` failed ("Couldn't swap")
    while an output was alive. The stand-in has the weight's shape, dtype and device (the
    backward reads them, once :func:`saved_operands` has expanded it) and is of the same kinds
    of tensor as :func:`kept_for_backward`'s; saved as its one value, unexpanded, for the
    same reason (a copying saved-tensors hook). A factory, not ``weight.new_zeros``: in a
    traced graph that would be a node reading the weight, which a partitioner recomputes in
    the backward from the weight it then keeps (``aot_eager``'s did). A plain weight's
    stand-in is made once per dtype, device and number of dimensions and shared by every graph
    (nothing writes into it: the backward reads only its expansion, which refuses in-place
    writes): this runs in most training forwards (every first layer), where a new tensor per
    call would be an allocation on the forward path.
    """
    if ctx.needs_input_grad[0] or type(weight) not in _KEEPABLE or torch._C._are_functorch_transforms_active():
        ctx.weight_stand_in_shape = None
        return weight
    ctx.weight_stand_in_shape = weight.shape
    if type(weight) not in _PLAIN or torch.compiler.is_compiling():
        return torch.zeros((1,) * weight.dim(), dtype=weight.dtype, device=weight.device)
    key = (weight.dim(), weight.dtype, weight.device)
    standin = _WEIGHT_STANDINS.get(key)
    if standin is None:
        if len(_WEIGHT_STANDINS) >= 256:
            _WEIGHT_STANDINS.clear()
        standin = torch.zeros((1,) * weight.dim(), dtype=weight.dtype, device=weight.device)
        _WEIGHT_STANDINS[key] = standin
    return standin


# (dimensions, dtype, device) -> the shared one-value stand-in of kept_weight_for_backward.
_WEIGHT_STANDINS: dict = {}


def _setup(ctx, inputs, output):
    x, weight, bias = inputs[:3]
    ctx.save_for_backward(kept_for_backward(ctx, x), kept_weight_for_backward(ctx, weight))
    ctx.save_for_forward(x, weight)
    ctx.has_bias = bias is not None
    if _fwad._current_level >= 0:
        # Operands without a tangent then reach _jvp as None, not as materialised zeros
        # that cost a second product (a frozen weight's zero tangent times x). Backward's
        # gradient may then be None too: the backward functions below answer it with None.
        ctx.set_materialize_grads(False)


def _functions(entry: OpEntry) -> None:
    """The three autograd Functions of ``entry``: eager (kernel), op autograd kernel, torch.func."""
    name = entry.name

    def backward_kernels(ctx, gy):
        if torch.compiler.is_compiling():  # first: dynamo folds it to a constant
            # Compiled autograd traces this backward with dynamo, which cannot trace the
            # kernels (ctypes, out= into strided views): the backward op is one graph node.
            return backward_op(ctx, gy)
        if gy is None:
            return None, None, None
        x, weight = saved_operands(ctx)
        if differentiable_backward_needed(gy, x, weight):
            return _differentiable_backward(name, ctx, gy, x, weight)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx, gw, gb = entry.run_backward(gy, x, weight, ctx.has_bias, need_x, need_w)
        return gx, gw, (gb if need_b else None)

    def backward_op(ctx, gy):
        if gy is None:
            return None, None, None
        x, weight = saved_operands(ctx)
        if differentiable_backward_needed(gy, x, weight):
            return _differentiable_backward(name, ctx, gy, x, weight)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx, gw, gb = entry.bwd_op(gy, x, weight, ctx.has_bias, need_x, need_w)
        return (gx if need_x else None), (gw if need_w else None), (gb if need_b and ctx.has_bias else None)

    # Eager and OpAutograd combine forward and context setup (the old style): with a separate
    # setup_context, Function.apply binds the arguments with inspect.signature on every call
    # (tens of us). Only the torch.func Function needs the separate form, and only it runs
    # under torch.func.
    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            _setup(ctx, (x, weight, bias), None)
            return _own(entry.forward(x, weight, bias), x, weight, bias)

        @staticmethod
        def backward(ctx, gy):
            return backward_kernels(ctx, gy)

        @staticmethod
        def jvp(ctx, tx, tw, tb):
            return _jvp(entry, ctx, tx, tw, tb)

    class OpAutograd(torch.autograd.Function):
        # Applied by the op's Autograd kernel: the forward re-enters the dispatcher below
        # autograd, so fake/meta/functional tensors reach the fake kernel, never the kernel.
        # It re-enters the same op, so a graph traced below autograd records the op itself:
        # an exported program's decompositions then stay differentiable when run. (An
        # autograd-free overload recorded instead spared compiled graphs this Python kernel
        # per call, but made those programs fail in backward: tests/test_transforms.py's
        # test_exported_backend_op_decomposes_saves_and_loads.)
        @staticmethod
        def forward(ctx, x, weight, bias, keyset):
            _setup(ctx, (x, weight, bias), None)
            with torch._C._AutoDispatchBelowAutograd():
                y = entry.fwd_op.redispatch(keyset & torch._C._after_autograd_keyset, x, weight, bias)
            return _own(y, x, weight, bias)

        @staticmethod
        def backward(ctx, gy):
            return (*backward_op(ctx, gy), None)

        @staticmethod
        def jvp(ctx, tx, tw, tb, _keyset):
            return _jvp(entry.call_op, ctx, tx, tw, tb)

    class Functorch(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x, weight, bias):
            return _own(entry.fwd_op(x, weight, bias), x, weight, bias)

        @staticmethod
        def setup_context(ctx, inputs, output):
            _setup(ctx, inputs, output)
            ctx.func_transform = True  # see _differentiable_backward

        @staticmethod
        def backward(ctx, gy):
            return backward_op(ctx, gy)

        @staticmethod
        def jvp(ctx, tx, tw, tb):
            return _jvp(entry.call_op, ctx, tx, tw, tb)

    entry._eager_fn, entry._op_fn, entry._py_fn = (
        _named(cls, f"{name}_{suffix}") for cls, suffix in ((Eager, "Eager"), (OpAutograd, "Op"), (Functorch, "Func"))
    )


def _own(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``y`` as a tensor of its own, not a view, for a Function to return.

    A kernel may return a view of its own work tensor (a permuted product reshaped, any
    reshape of an empty one). Returned from a Function, autograd refuses to let the caller
    change it in place (``nn.ReLU(inplace=True)`` after the layer), which ``nn.Linear``'s
    output allows. Detaching drops only the view relation, not the data. A view of an input
    is copied instead, so that changing the output never changes the input.
    """
    if not y._is_view():
        return y
    base = y._base
    for t in (x, weight, bias):
        if t is not None and (base is t or base is t._base):
            return y.clone()
    return y.detach()


def _named(cls: type, name: str) -> type:
    """``cls`` rebuilt under ``name``: autograd names the graph node (``<name>Backward``) at class creation."""
    keep = ("forward", "setup_context", "backward", "jvp", "generate_vmap_rule")
    return type(name, (torch.autograd.Function,), {k: v for k, v in vars(cls).items() if k in keep})


def _unviewed(y: torch.Tensor, *operands: Optional[torch.Tensor]) -> torch.Tensor:
    """A batching rule's result as a tensor of its own where nothing differentiates it (:func:`_own`).

    Under ``vmap`` the Functions' generated batching rule (``generate_vmap_rule``) returns
    what the op's rule returns from the Function's forward, which runs under ``no_grad``: a
    reshape of the product would be a view returned from a Function, and autograd refused
    the in-place change (``nn.ReLU(inplace=True)`` after the layer) that ``nn.Linear``'s
    output allows. Where grad mode is on (a traced graph differentiating the rule's ops) the
    view is kept: detaching it there would cut the gradient.
    """
    return _own(y, *operands) if not torch.is_grad_enabled() else y


def _vmap_rule(op, entry: Optional[OpEntry] = None):
    """Batching rule: vmapped weights become more groups of one product; a vmapped input more rows.

    A backend with ``forward_copies`` runs the copies of a vmapped weight through it instead.
    """

    def rule(info, in_dims, x, weight, bias):
        xd, wd, bd = in_dims
        nb = info.batch_size
        if wd is None and bd is None:
            x = x.movedim(xd, 0)
            y = op(x.reshape(nb * x.shape[1], x.shape[2]), weight, bias)
            return _unviewed(y.reshape(nb, x.shape[1], y.shape[-1]), x, weight, bias), 0
        w = weight.movedim(wd, 0) if wd is not None else weight.expand(nb, *weight.shape)
        b = None if bias is None else (bias.movedim(bd, 0) if bd is not None else bias.expand(nb, *bias.shape))
        if entry is not None and entry.forward_copies is not None:
            # The op's checks, on one copy's operands (views: nothing is copied).
            check_operands(entry.name, *(t if d is None else t.select(d, 0)
                                         for t, d in ((x, xd), (weight, wd), (bias, bd))))
            y = entry.forward_copies(x.movedim(xd, 0) if xd is not None else x[None], w, b)
            return _unviewed(y, x, weight, bias), 0
        g = w.shape[1]
        wf = w.reshape(nb * g, w.shape[2], w.shape[3])
        bf = None if b is None else b.reshape(-1)
        if xd is None:
            xf = x.repeat(1, nb)  # every copy of the groups reads the same input
        else:
            x = x.movedim(xd, 0)
            xf = x.permute(1, 0, 2).reshape(x.shape[1], nb * x.shape[2])
        y = op(xf, wf, bf)
        return _unviewed(y.reshape(y.shape[0], nb, y.shape[1] // nb), x, weight, bias), 1

    return rule


def _flops_forward(x_shape, w_shape, *args, **kwargs) -> int:
    g, o, i = w_shape
    return 2 * x_shape[0] * g * i * o


def _flops_backward(grad_shape, x_shape, w_shape, has_bias, need_input, need_weight, *args, **kwargs) -> int:
    return (int(need_input) + int(need_weight)) * _flops_forward(x_shape, w_shape)


def _register_flops(fwd, bwd) -> None:
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(fwd.overloadpacket)(_flops_forward)
    register_flop_formula(bwd.overloadpacket)(_flops_backward)


def define(entry: OpEntry) -> OpEntry:
    """Register ``entry``'s forward and backward ops (``blockdiag::<name>[_backward]``)."""
    name = entry.name
    if name in _ENTRIES:
        raise BlockDiagError(f"define: an op for backend {name!r} is already defined")
    LIB.define(name + FORWARD_SCHEMA)
    LIB.define(name + "_backward" + BACKWARD_SCHEMA)
    entry.fwd_op = getattr(torch.ops.blockdiag, name).default
    entry.bwd_op = getattr(torch.ops.blockdiag, name + "_backward").default
    LIB.impl(name, entry._impl, "CompositeExplicitAutograd")
    LIB.impl(name + "_backward", entry._bwd_impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"blockdiag::{name}", entry._fake, lib=LIB)
    torch.library.register_fake(f"blockdiag::{name}_backward", entry._bwd_fake, lib=LIB)
    _functions(entry)

    def autograd_kernel(keyset, x, weight, bias):
        if torch._C._are_functorch_transforms_active():
            return transform_forward(entry)(x, weight, bias)
        if _records(x, weight, bias) or forward_ad_active(x, weight, bias):
            return entry._op_fn.apply(x, weight, bias, keyset)
        return entry.fwd_op.redispatch(keyset & torch._C._after_autograd_keyset, x, weight, bias)

    LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    torch.library.register_vmap(f"blockdiag::{name}", _vmap_rule(entry.fwd_op, entry), lib=LIB)
    register_autocast(name, entry.fwd_op)
    _register_flops(entry.fwd_op, entry.bwd_op)
    _ENTRIES[name] = entry
    return entry


def register_autocast(name: str, op) -> None:
    """Autocast kernels for forward op ``blockdiag::<name>``: its tensor operands cast as ``F.linear``'s.

    The layers cast in Python before they call an op, but a graph that calls the op itself
    (an exported program, a ``jit.trace``, an AOTInductor package) run under autocast reaches
    the op with the parameters' dtype, where ``nn.Linear``'s ``aten::linear`` is cast by
    autocast. Floating operands other than float64 are cast to the autocast dtype of the
    device, whatever it is at the call (``torch.library.register_autocast`` fixes one dtype).
    """
    for device_type in ("cpu", "cuda"):
        if not torch._C._is_autocast_available(device_type):
            continue
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, _device_type=device_type, _excluded=excluded):
            dt = torch.get_autocast_dtype(_device_type)
            args = tuple(
                a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != dt
                and a.dtype != torch.float64 else a
                for a in args
            )
            with torch._C._ExcludeDispatchKeyGuard(_excluded):
                return op(*args)

        LIB.impl(name, kernel, key, with_keyset=True)


def transform_forward(entry: Optional[OpEntry]) -> Forward:
    """The forward an op runs when it is reached under a ``torch.func`` transform.

    That happens where the op is called directly under the transform (an exported
    program's graph run under ``torch.func.grad``) and where ``torch.compile`` traces a
    transform (dynamo and AOTAutograd call the op with the transform's tensors). There
    functorch cannot run an autograd Function from inside an op's kernel: its
    ``custom_function_call`` has no kernel below the transform's layer, a limit torch's own
    ``custom_op`` shares. So the op runs its product as torch ops, which every transform
    differentiates and batches itself, and a compiled transform is one graph: the backend's
    forward where it is torch ops (``inlinable``), else ``bmm``'s (one batched matmul on
    strided views). In eager mode the layers call the Function themselves (``call_op``), and
    their kernels run.
    """
    return entry.forward if entry is not None and entry.inlinable else _ENTRIES["bmm"].forward


def entries() -> dict[str, OpEntry]:
    """The defined ops by backend name."""
    return dict(_ENTRIES)


def _op_backend(fn: str, name: str) -> str:
    """``name`` where it is a backend with ops (or ``"auto"``), else a :class:`BlockDiagError`.

    Without the check, torch answers an AttributeError about its op namespace for a backend
    registered in torch operations (which has no op: it runs as it is), and returns the op of
    another name in the namespace (``fm_rows``, ``simd_native``) as if it were a backend's.
    """
    if name != "auto" and name not in _ENTRIES:
        raise BlockDiagError(
            f"{fn}: {name!r} is not a backend with ops; those are 'auto', {', '.join(map(repr, _ENTRIES))} "
            "(a backend registered with plain torch operations has none: it runs as it is)"
        )
    return name


def forward_op(name: str):
    """The forward op ``torch.ops.blockdiag.<name>.default`` of backend ``name`` (or ``"auto"``)."""
    return getattr(torch.ops.blockdiag, _op_backend("forward_op", name)).default


def backward_op(name: str):
    """The backward op ``torch.ops.blockdiag.<name>_backward.default`` of backend ``name`` (or ``"auto"``)."""
    return getattr(torch.ops.blockdiag, _op_backend("backward_op", name) + "_backward").default
