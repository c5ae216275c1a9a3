"""``blockdiag::auto``: the chooser inside one op, for graphs that must serve every batch size.

In eager mode ``backend="auto"`` plans in Python (``GroupedLinear``'s memo) and calls the chosen
backend. A traced graph (``torch.compile``, ``torch.export``, ``jit.trace``) cannot do that
without fixing the batch: the plan depends on it. So there the layer records this one op,
whose kernel plans per call at run time, with the concrete batch, exactly as eager does
(:func:`blockdiag.choose` on the same :class:`~blockdiag.Problem`, from the same cache), then runs
the chosen backend's kernel. ``train`` (whether autograd records the product, which the plan
keys on) is decided when tracing, where it is known. The backward op plans the same problem
with ``train=True``, so it runs the backward of the backend the forward ran. Its fake kernel
gives a contiguous ``[N, G*out]``, and the kernel returns one whichever backend ran.

``blockdiag::auto_inline`` is what ``torch.compile`` and ``torch.export`` record. It is a
composite op (``CompositeImplicitAutograd``): AOTAutograd, export and FakeTensor run its Python
body with the traced operands instead of keeping it in the graph. Where that body sees a
symbolic batch (a graph that serves every batch size) it records ``blockdiag::auto``, as above.
Where the batch is a number (a graph specialised to it, as ``torch.compile`` makes first) it
plans there, with eager's cache, and records the chosen backend's own torch ops when the
backend is written in them, backward included (``OpEntry.inlinable``: ``bmm_fm``, ``bmm``,
``bmm_fm_bmm``, ``conv``, ``dense``), so inductor sees and fuses them as it fuses
``nn.Linear``; a backend that is C, or whose backward writes into slices (``loop``,
``bmm_fm_loop``), or whose operands are a tensor subclass (DTensor, which the op's sharding
rules handle), is recorded as ``blockdiag::auto``. Either way the graph runs eager
``auto``'s choice. Where that choice's kernels are C++ torch ops (``simd``'s, once built and
checked), a graph ``torch.compile`` traces at a concrete batch records those ops, forward and
backward, instead of ``blockdiag::auto``: no blockdiag Python runs per call (``_NativeRoute``).
Dynamo guards the graph on :data:`blockdiag.settings.generation` (see
``nn/linear.py``), so a settings, profile or registry change recompiles it and the choice
follows. The recompiled graph must also differ from the old one: torch keeps compiled graphs
in caches keyed by the graph (AOTAutograd's and inductor's, on disk across processes), which
would hand back the old plan. So the op takes :func:`blockdiag.dispatch.plan_state`, a digest
of what plans read besides the problem, as its ``state`` argument.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .. import settings as _settings
from ..backends import Problem, get
from ..backends._registry import check_result
from ._define import (
    _ENTRIES,
    _PLAIN,
    BACKWARD_SCHEMA,
    LIB,
    _contiguous,
    _jvp,
    _placeholders,
    _records,
    _named,
    _own,
    _setup,
    check_backward_operands,
    differentiable_backward_needed,
    fake_backward,
    forward_ad_active,
    functorch_function_route,
    generic_backward,
    kept_for_backward,
    kept_weight_for_backward,
    register_autocast,
    rows_pay,
    saved_operands,
    transform_forward,
    validate_operands,
)

__all__ = ["auto", "auto_inline", "choice", "native_routes", "route_token", "traced_routes"]

LIB.define("auto(Tensor x, Tensor weight, Tensor? bias, bool train) -> Tensor")
LIB.define("auto_backward" + BACKWARD_SCHEMA)
LIB.define("auto_inline(Tensor x, Tensor weight, Tensor? bias, bool train, str state=\"\") -> Tensor")
FORWARD = torch.ops.blockdiag.auto.default
BACKWARD = torch.ops.blockdiag.auto_backward.default
INLINE = torch.ops.blockdiag.auto_inline.default
_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView


# (rows, weight shape, dtype, device type, train, plain, epoch) -> backend name: the op runs
# once per call of a compiled graph, and building the Problem costs more than the lookup.
_CHOICE: dict = {}


def choice(x: torch.Tensor, weight: torch.Tensor, train: bool, plain: bool = True) -> str:
    """The backend ``auto`` runs for a 2-D ``x`` and ``weight`` (what eager ``auto`` picks).

    ``plain``: every operand is a plain ``torch.Tensor`` (or ``Parameter``). Where one is not
    (a ``torch.Tensor`` subclass reaches the kernels as itself), a C backend cannot take its
    pointer, so the plan's best-ranked backend written in torch ops runs instead.
    """
    ep = _settings.epoch()
    key = (x.shape[0], weight.shape, x.dtype, x.device.type, train, plain, ep)
    name = _CHOICE.get(key)
    if name is None:
        from ..dispatch import choose

        g, o, i = weight.shape
        plan = choose(Problem(int(x.shape[0]), g, i, o, x.dtype, x.device.type, bool(train)))
        name = plan.backend
        if not plain:
            name = next((c.name for c in plan.candidates if c.ok and not _native(c.name)), name)
        # Kept only if the epoch did not move while planning (another thread's set_config or
        # environment change): the plan may be of the new state, and an environment variable
        # set back would bring the old key, and this stale answer, back (as nn.linear._select).
        if ep == _settings.epoch():
            if len(_CHOICE) > 4096:
                _CHOICE.clear()
            _CHOICE[key] = name
    return name


def _native(name: str) -> bool:
    entry = _ENTRIES.get(name)
    return entry is not None and entry.native


def _plain(a, b, c) -> bool:
    return type(a) in _PLAIN and type(b) in _PLAIN and (c is None or type(c) in _PLAIN)


def _forward_kernel(name, x, weight, bias):
    entry = _ENTRIES.get(name)
    if entry is None:  # a backend registered without ops: its function, without autograd
        with torch.no_grad():
            return check_result(name, get(name).fn(x, weight, bias), x, weight, bias)
    entry._guard(("input", x), ("weight", weight), ("bias", bias))
    entry.run_check(x, weight, bias)
    if entry.rows is not None and rows_pay(weight.shape[1], x.dtype):
        # The op's result is contiguous: a feature-major backend writes it directly.
        return entry.rows(x, weight, bias)
    return entry.forward(x, weight, bias)


def _impl(x, weight, bias, train):
    validate_operands("auto", x, weight, bias)
    return _contiguous(_forward_kernel(choice(x, weight, train, _plain(x, weight, bias)), x, weight, bias))


def _fake(x, weight, bias, train):
    g, o, _ = weight.shape
    return x.new_empty(x.shape[0], g * o)


def _bwd_impl(gy, x, weight, has_bias, need_x, need_w):
    check_backward_operands("auto_backward", gy, x, weight)
    name = choice(x, weight, True, _plain(gy, x, weight))
    entry = _ENTRIES.get(name)
    if entry is not None:
        # The training plan may name a backend the forward (planned for inference: jit.trace,
        # train=False) never ran, whose self-check has then not run either.
        entry.run_check(x, weight, None)
    if entry is None:
        gx, gw, gb = generic_backward(gy, x, weight, has_bias, need_x, need_w, True)
    elif need_x and entry.rows_input_grad is not None and rows_pay(weight.shape[2], gy.dtype):
        # The backward of a feature-major backend forms the input gradient in another order
        # and copies it into rows; the same product is written into them directly instead.
        gx = entry.rows_input_grad(gy, weight)
        _, gw, gb = entry.run_backward(gy, x, weight, has_bias, False, need_w)
    else:
        gx, gw, gb = entry.run_backward(gy, x, weight, has_bias, need_x, need_w)
    return _placeholders(gy, x, weight, has_bias, gx, gw, gb)


def _backward(ctx, gy):
    if gy is None:  # possible under forward AD only (see _define._setup)
        return None, None, None
    x, weight = saved_operands(ctx)
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if differentiable_backward_needed(gy, x, weight):
        # auto always has a differentiable backward: double backward, torch.func and
        # forward-over-reverse use it.
        return generic_backward(gy, x, weight, ctx.has_bias, need_x, need_w, need_b)
    gx, gw, gb = BACKWARD(gy, x, weight, ctx.has_bias, need_x, need_w)
    return (gx if need_x else None), (gw if need_w else None), (gb if need_b and ctx.has_bias else None)


def _train_jvp(x, weight, bias):
    return auto(x, weight, bias, False)


class _OpAutograd(torch.autograd.Function):
    # Old style (forward with ctx): see _define's note on setup_context's per-call cost.
    @staticmethod
    def forward(ctx, x, weight, bias, train, keyset):
        _setup(ctx, (x, weight, bias), None)
        with torch._C._AutoDispatchBelowAutograd():
            return FORWARD.redispatch(keyset & torch._C._after_autograd_keyset, x, weight, bias, train)

    @staticmethod
    def backward(ctx, gy):
        return (*_backward(ctx, gy), None, None)

    @staticmethod
    def jvp(ctx, tx, tw, tb, _train, _keyset):
        return _jvp(_train_jvp, ctx, tx, tw, tb)


class _Functorch(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, train):
        return _own(FORWARD(x, weight, bias, train), x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx, gy):
        return (*_backward(ctx, gy), None)

    @staticmethod
    def jvp(ctx, tx, tw, tb, _train):
        return _jvp(_train_jvp, ctx, tx, tw, tb)


_OpAutograd = _named(_OpAutograd, "auto_Op")
_Functorch = _named(_Functorch, "auto_Func")


def _autograd_kernel(keyset, x, weight, bias, train):
    if torch._C._are_functorch_transforms_active():
        return _transform_forward(x, weight, train)(x, weight, bias)
    if _records(x, weight, bias) or forward_ad_active(x, weight, bias):
        return _OpAutograd.apply(x, weight, bias, train, keyset)
    return FORWARD.redispatch(keyset & torch._C._after_autograd_keyset, x, weight, bias, train)


def _vmap(info, in_dims, x, weight, bias, train):
    from ._define import _vmap_rule

    return _vmap_rule(lambda a, b, c: FORWARD(a, b, c, train))(info, in_dims[:3], x, weight, bias)


def _vmap_inline(info, in_dims, x, weight, bias, train, state=""):
    # Without a rule, vmap inside torch.compile (the ensembling recipe) ran torch's batched
    # fallback: the op once per vmapped slice.
    from ._define import _vmap_rule

    return _vmap_rule(lambda a, b, c: INLINE(a, b, c, train, state))(info, in_dims[:3], x, weight, bias)


def _inline(x, weight, bias, train, state=""):
    # ``state`` (blockdiag.dispatch.plan_state, and the native routes torch.compile may take:
    # see _NativeRoute) is in the graph so that torch's compile caches, keyed by the graph,
    # tell graphs planned under other settings, or with other routes, apart.
    # Python ints are concrete batches; torch.SymInt is a graph serving every batch size
    # (a SymInt that tracing specialised, e.g. to 0 or 1, arrives here as an int). A tensor
    # subclass (DTensor) keeps the op, whose sharding rules run the local kernels without
    # gathering and refuse what they cannot shard; the chooser would see global shapes here.
    if _symbolic(x, weight) or any(map(_is_subclass, (x, weight, bias))):
        return FORWARD(x, weight, bias, train)
    if torch._C._are_functorch_transforms_active():
        # torch.compile tracing a torch.func transform: torch ops (see transform_forward).
        return _transform_forward(x, weight, train)(x, weight, bias)
    entry = _ENTRIES.get(choice(x, weight, train))
    # Below autograd (ADInplaceOrView excluded: torch.cond tracing its branches, which it
    # differentiates itself afterwards) the native route's C++ ops would be recorded without
    # their autograd Function, and forward_ad_active's _unpack_dual reaches an inference-only
    # kernel of torch's that asserts; the op and the eager route differentiate there.
    if entry is not None and entry.compiled_ops is not None and x.numel() and weight.numel() \
            and route_token(entry.name, x.dtype) in state.split() \
            and not torch._C._dispatch_tls_is_dispatch_key_excluded(_AD_INPLACE_OR_VIEW) \
            and not forward_ad_active(x, weight, bias):
        ops = entry.compiled_ops().get(x.dtype)
        if ops is not None and x.device.type == "cpu":
            return _NativeRoute.apply(x, weight, bias, ops)
    if entry is None or not entry.inlinable:
        return FORWARD(x, weight, bias, train)
    if train and entry.rows is not None and _rows_op_pays(x, weight):
        # Inlined, a feature-major backend returns a transposed view, and AOTAutograd then
        # hands the backward a gradient of the output's strides: a transposing copy of the
        # caller's row-major gradient per step, and products on the copy. The op writes
        # rows and takes the gradient as it comes (docs/design.md).
        return FORWARD(x, weight, bias, train)
    # The eager route: the forward's torch ops, inside the backend's autograd Function where
    # its backward is its own kernels, so the traced backward is the one eager runs.
    return entry.eager(x, weight, bias)


def _transform_forward(x, weight, train: bool):
    """:func:`~blockdiag.ops._define.transform_forward` of the plan's best-ranked backend in torch ops.

    Where a size is symbolic (the plan needs numbers), or no candidate is in torch ops,
    ``bmm``'s forward.
    """
    from ..dispatch import choose

    if not _symbolic(x, weight):
        g, o, i = weight.shape
        plan = choose(Problem(int(x.shape[0]), g, i, o, x.dtype, x.device.type, bool(train)))
        for c in plan.candidates:
            entry = _ENTRIES.get(c.name)
            if c.ok and entry is not None and entry.inlinable:
                return entry.forward
    return transform_forward(None)


def route_token(name: str, dtype: torch.dtype) -> str:
    """The token naming backend ``name``'s native route for ``dtype`` in a plan state."""
    return f"native:{name}:{str(dtype).removeprefix('torch.')}"


def native_routes() -> str:
    """The native routes ready now, as ``auto_inline``'s ``state`` carries them (see ``_inline``).

    One token per backend and dtype whose C++ ops (``OpEntry.compiled_ops``) are ready, e.g.
    ``"native:simd:float32 native:simd:float64"``; empty where there are none.
    """
    return " ".join(sorted(route_token(e.name, dt) for e in _ENTRIES.values() if e.compiled_ops is not None
                           for dt in e.compiled_ops()))


def traced_routes(dtype: Optional[torch.dtype] = None, device_type: str = "cpu") -> str:
    """:func:`native_routes` under ``torch.compile``; empty while ``torch.export`` traces.

    With ``dtype``, each backend's C++ ops are first made ready for it where they can be
    (``OpEntry.prepare_ops``: built, loaded, checked, armed, as a backend's first eager call
    does): a graph traced before any eager call, the usual order for a model compiled right
    away, then records the native route as one traced after an eager call does, instead of
    the op with its Python per call.
    """
    if torch.compiler.is_exporting():
        return ""
    if dtype is not None:
        for e in _ENTRIES.values():
            if e.prepare_ops is not None and e.compiled_ops is not None and dtype not in e.compiled_ops():
                e.prepare_ops(dtype, device_type)
    return native_routes()


class _NativeRoute(torch.autograd.Function):
    """A backend's C++ ops, forward and backward, as ``torch.compile`` records them.

    The op route runs Python per call in a compiled graph: ``blockdiag::auto``'s autograd and
    CPU kernels, the choice's lookup and the backend's checks, forward and backward. Where
    ``auto`` chose a backend whose kernels are C++ torch ops, the graph records those ops
    instead, and a compiled step runs no blockdiag Python. Only where ``state`` names the
    route (``native_routes``): the graph then differs from one recorded without it, so
    torch's compile caches, keyed by the graph, never hand a graph calling the ops to a
    process that has not loaded and checked them. ``torch.export`` never names it: an
    exported program keeps the op, whose autograd its decompositions need.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, ops):
        ctx.save_for_backward(kept_for_backward(ctx, x), kept_weight_for_backward(ctx, weight))
        ctx.has_bias, ctx.ops = bias is not None, ops
        return ops.forward(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = saved_operands(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx, gw, gb = ctx.ops.backward(gy, x, weight, ctx.has_bias, need_x, need_w)
        return (gx if need_x else None), (gw if need_w else None), (gb if need_b and ctx.has_bias else None), None


# The op costs a compiled training step more than inlined torch ops at small batches (its
# Python kernels, forward and backward, and batched products on 32 rows that gain nothing from
# the direct write), while what it saves, the transposing copies of the gradient, grows with
# the batch. ``scripts/bench_rows.py --compiled`` times the two graphs of each point: on the
# CPU measured the op lost at 32 rows and won from 256.
ROWS_OP_MIN_BATCH = 256


def _rows_op_pays(x, weight) -> bool:
    """Whether a traced training graph records the op for a feature-major choice (see above)."""
    return x.shape[0] >= ROWS_OP_MIN_BATCH and rows_pay(weight.shape[1], x.dtype)


def _symbolic(x, weight) -> bool:
    """Whether the batch or a weight dimension is a symbol (a graph serving several sizes).

    The plan needs numbers: ``torch.compile`` makes the weight's sizes symbolic too once it
    has seen two (automatic dynamic shapes), and a symbolic size is no key of the plan cache.
    """
    return isinstance(x.shape[0], torch.SymInt) or any(isinstance(d, torch.SymInt) for d in weight.shape)


def _is_subclass(t) -> bool:
    # FakeTensor and FunctionalTensor (what tracing passes) are not traceable wrapper
    # subclasses; DTensor is.
    return t is not None and is_traceable_wrapper_subclass(t)


LIB.impl("auto", _impl, "CompositeExplicitAutograd")
LIB.impl("auto_inline", _inline, "CompositeImplicitAutograd")
LIB.impl("auto_backward", _bwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake("blockdiag::auto", _fake, lib=LIB)
torch.library.register_fake("blockdiag::auto_backward", fake_backward, lib=LIB)
LIB.impl("auto", _autograd_kernel, "Autograd", with_keyset=True)
torch.library.register_vmap("blockdiag::auto", _vmap, lib=LIB)
register_autocast("auto", FORWARD)
# auto_inline is composite: without its own autocast kernel, a decomposition traced under
# autocast (an exported program's run_decompositions inside a model's autocast block) ran
# its body on the uncast operands and recorded a float32 product.
register_autocast("auto_inline", INLINE)
torch.library.register_vmap("blockdiag::auto_inline", _vmap_inline, lib=LIB)


def _register_flops() -> None:
    from torch.utils.flop_counter import register_flop_formula

    from ._define import _flops_backward, _flops_forward

    register_flop_formula(FORWARD.overloadpacket)(_flops_forward)
    register_flop_formula(BACKWARD.overloadpacket)(_flops_backward)


_register_flops()


def auto_inline(x: torch.Tensor, weight: torch.Tensor, bias, train: bool, state: str = "") -> torch.Tensor:
    """The ``auto_inline`` op on a 2-D ``x``: what traced graphs record (see the module's note).

    ``state`` is :func:`blockdiag.dispatch.plan_state` when tracing: it only tells graphs
    planned under other settings apart.
    """
    if functorch_function_route():
        return _Functorch.apply(x, weight, bias, train)  # see OpEntry.call_op
    return INLINE(x, weight, bias, train, state)


def auto(x: torch.Tensor, weight: torch.Tensor, bias, train: bool) -> torch.Tensor:
    """The ``auto`` op on a 2-D ``x`` (through ``torch.func``'s Function under a transform)."""
    if functorch_function_route():
        return _Functorch.apply(x, weight, bias, train)  # see OpEntry.call_op
    return FORWARD(x, weight, bias, train)
