"""``GroupedLinear``: G independent linear layers as one module with a pluggable multiply."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Callable, ParamSpec, Sequence, TypeVar

import torch
from torch import nn
from torch.autograd import forward_ad as _fwad
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm as _SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm as _WeightNorm

from .._checks import as_size, check, check_groups, check_operand_kinds, check_same_device_dtype
from .._errors import BlockDiagError
from ..backends import Problem, get
from ..backends._registry import check_dtype, check_result
from ..backends._registry import names as _backend_names
from .. import settings as _settings
from ..dispatch import Plan, plan_for, plan_state
from ..ops import OpEntry, plain_eager
from ..ops import _sharding
from ..ops._define import transform_forward
from ..ops.auto import auto as _auto_op
from ..ops.auto import auto_inline as _auto_inline_op
from ..ops.auto import traced_routes

__all__ = ["GroupedLinear", "grouped_linear"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def check_plain_linear(fn: str, lin: object, where: str) -> None:
    """Refuse ``lin`` unless it computes ``x @ weight.T + bias`` with no state of its own.

    Converting copies ``weight`` and ``bias`` only: a subclass that overrides ``forward``
    (a LoRA adapter) or holds more parameters would be converted into something else,
    silently. A parametrized Linear (``mask_block_diagonal_``) is plain: its ``weight`` is
    the computed one.

    Raises:
        BlockDiagError: not an ``nn.Linear``, an uninitialized ``LazyLinear``, a subclass
            with its own ``forward`` (or one set on the instance) or ``__call__``, other
            parameters, buffers or modules, hooks (on the module or on its parameters), or
            a ``weight`` or ``bias`` computed from other tensors (not a Parameter).
    """
    check(fn, isinstance(lin, nn.Linear), f"{where} is a {type(lin).__name__}, not nn.Linear")
    check(
        fn,
        not isinstance(lin.weight, nn.parameter.UninitializedParameter),
        f"{where} is an uninitialized {type(lin).__name__}: run one forward through it first",
    )
    check(
        fn,
        type(lin).forward is nn.Linear.forward,
        f"{where} is a {type(lin).__name__}, whose own forward is not nn.Linear's: converting copies "
        "only weight and bias, so it would compute something else",
    )
    # A forward set on the instance (monkeypatched, or a wrapper such as accelerate's hooks)
    # is what __call__ runs, whatever the class defines.
    check(
        fn,
        "forward" not in vars(lin),
        f"{where} has its forward replaced on the instance: converting copies only weight and bias, "
        "so it would compute nn.Linear's product instead",
    )
    call = replaced_call(lin)
    check(
        fn,
        call is None,
        f"{where} {call}: converting copies only weight and bias, so it would compute nn.Linear's "
        "product instead",
    )
    extra = [n for n, _ in (*lin.named_parameters(), *lin.named_buffers())
             if n not in ("weight", "bias") and not n.startswith("parametrizations.")]
    check(
        fn,
        not extra,
        f"{where} is a {type(lin).__name__} with more state than weight and bias ({', '.join(extra)}), "
        "which converting would drop",
    )
    hooked = lin._forward_hooks or lin._forward_pre_hooks or lin._backward_hooks or lin._backward_pre_hooks
    check(fn, not hooked, f"{where} has forward or backward hooks, which the converted module would not run")
    # A weight set as a computed tensor (del lin.weight; lin.weight = hyper(z), or W * scale)
    # trains what it is computed from, which may tie it to other heads through a tensor no
    # memory check sees; the converted module's parameter would be a leaf copy of its value.
    # A parametrized one is computed as well, and converts as documented.
    computed = [f"{n} (grad_fn={type(t.grad_fn).__name__})" for n in ("weight", "bias")
                if not parametrize.is_parametrized(lin, n)
                and (t := getattr(lin, n, None)) is not None and t.grad_fn is not None]
    check(
        fn,
        not computed,
        f"{where} has {', '.join(computed)} computed from other tensors, not a Parameter: the loop's "
        "gradients reach what it is computed from, while the converted module would train a copy of its "
        "value; give it its own nn.Parameter (or convert the module that computes it)",
    )
    # Hooks on a parameter (Tensor.register_hook, register_post_accumulate_grad_hook) change
    # or act on its gradient; the converted module's parameters are new tensors without them.
    grad_hooked = [n for n, p in lin.named_parameters()
                   if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
    check(
        fn,
        not grad_hooked,
        f"{where} has gradient hooks on {', '.join(grad_hooked)} (Tensor.register_hook or "
        "register_post_accumulate_grad_hook), which the converted module's parameters would not run; "
        "remove them, convert, and register them on the new parameters",
    )


def replaced_call(m: nn.Module) -> str | None:
    """How calling ``m`` runs something other than ``nn.Module``'s call of its ``forward`` (None if not).

    ``module(x)`` runs ``type(module).__call__``, which in ``nn.Module`` runs
    ``self._call_impl`` (the hooks, then ``forward``): a class that overrides either, or a
    ``_call_impl`` set on the instance, decides what a call computes whatever ``forward`` is.
    """
    cls = type(m)
    if cls.__call__ is not nn.Module.__call__:
        return f"is a {cls.__name__}, which overrides __call__"
    if cls._call_impl is not nn.Module._call_impl:
        return f"is a {cls.__name__}, which overrides _call_impl"
    if "_call_impl" in vars(m):
        return "has its _call_impl replaced on the instance"
    return None


def computing_once(convert: Callable[_P, _R]) -> Callable[_P, _R]:
    """``convert`` (a conversion from modules) with each parametrized tensor computed once.

    A parametrized ``weight`` is computed on every read (``spectral_norm`` steps its power
    iteration, a random parametrization draws again, a costly one costs again), and the
    checks of a conversion read it as well as the copy: many steps for ``heads[0]``, whose
    every check reads it. Under ``parametrize.cached()`` each module's value is computed at
    its first read, as the module's own next forward would compute it, and every later read
    is that value, so the copy is what the heads compute.
    """

    @functools.wraps(convert)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with parametrize.cached():
            return convert(*args, **kwargs)

    return run


def _refuse_shared_parameters(fn: str, named: list) -> None:
    """Refuse Linears that share a parameter (weight tying, one module twice): the grouped
    layer holds one copy per group, which would then train apart.

    Two distinct Parameters over the same memory (``nn.Parameter(a.weight.data)``, or a view
    of it) are tied as well: a step on one changes the other. They are found by their
    storage and the bytes each reads in it; tensors without real storage (meta, fake, a
    subclass) are compared by identity only.
    """
    seen: dict = {}  # id -> (name, tensor): the tensor kept alive, so that its id is not reused
    spans: dict = {}  # (device, storage address) -> [(order, name, tensor, first byte, end byte)]
    for where, lin in named:
        for pname in ("weight", "bias"):
            # A parametrized parameter is computed per access: its originals are what is shared
            # (``original``, or ``original0``, ``original1``... as weight_norm keeps them).
            plist = getattr(getattr(lin, "parametrizations", None), pname, None)
            if plist is not None:
                ts = [(f"{where}.parametrizations.{pname}.{n}", t) for n, t in plist._parameters.items()]
            else:
                ts = [(f"{where}.{pname}", getattr(lin, pname, None))]
            for name, t in ts:
                if t is None:
                    continue
                if id(t) in seen:
                    other = seen[id(t)][0]
                    check(fn, other == name,
                          f"{name} is the same parameter as {other} (tied weights): the grouped "
                          "module holds one copy per group, so they would no longer be tied; untie them first "
                          "(copy.deepcopy each, to start the groups from the same values)")
                    continue
                seen[id(t)] = (name, t)
                if type(t) in (torch.Tensor, nn.Parameter) and not t.is_meta and t.layout == torch.strided \
                        and t.numel() > 0:
                    ptr = t.untyped_storage().data_ptr()
                    if ptr:  # an address of 0 is no memory to share
                        spans.setdefault((t.device, ptr), []).append((len(seen), name, t, *_byte_span(t)))
    for group in spans.values():
        group.sort(key=lambda e: e[3])  # by first byte
        # Disjoint spans (Parameters sliced from one flat buffer, as FSDP keeps them) share no
        # byte; only where one span reaches into the next are the bytes themselves compared.
        if all(a[4] <= b[3] for a, b in zip(group, group[1:])):
            continue
        lo = group[0][3]
        mask = torch.zeros(max(e[4] for e in group) - lo, dtype=torch.bool, device=group[0][2].device)
        for k, (_, name, t, *_) in enumerate(group):
            if bool(_bytes_of(mask, lo, t).any()):
                # An earlier span holds one of these bytes: find which, for the message.
                other = next(e for e in group[:k] if _bytes_overlap(e[2], t))
                first, second = sorted((other, group[k]), key=lambda e: e[0])  # in the order given
                raise BlockDiagError(
                    f"{fn}: {second[1]} shares memory with {first[1]} (distinct Parameters over one "
                    "storage, tied as one shared Parameter is): the grouped module holds one copy per "
                    "group, so they would no longer be tied; untie them first (give each its own copy, "
                    "nn.Parameter(p.detach().clone()))")
            _bytes_of(mask, lo, t).fill_(True)


def _byte_span(t: torch.Tensor) -> tuple:
    """The first and one past the last byte of its storage that ``t`` (not empty) reads."""
    e = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * e, (t.storage_offset() + last + 1) * e


def _bytes_of(mask: torch.Tensor, lo: int, t: torch.Tensor) -> torch.Tensor:
    """The entries of ``mask`` (one per byte of a storage, from byte ``lo``) of the bytes ``t`` reads.

    Spans can intersect without a shared byte (two column slices of one matrix), so bytes
    are compared, not spans: each element's bytes are a trailing dimension of stride 1.
    """
    e = t.element_size()
    return mask.as_strided((*t.shape, e), (*(s * e for s in t.stride()), 1), t.storage_offset() * e - lo)


def _bytes_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b``, on one storage, read a byte in common."""
    (alo, ahi), (blo, bhi) = _byte_span(a), _byte_span(b)
    lo = min(alo, blo)
    mask = torch.zeros(max(ahi, bhi) - lo, dtype=torch.bool, device=a.device)
    _bytes_of(mask, lo, a).fill_(True)
    return bool(_bytes_of(mask, lo, b).any())


def _trains(module: nn.Module, name: str, value: torch.Tensor) -> bool:
    """Whether ``module.<name>``, read as ``value``, trains: whether a gradient reaches a parameter.

    A parametrized tensor is computed from the parametrization's parameters (``original``,
    and any of the parametrization's own) on every read, and the computed value requires grad
    only where grad mode was on at the read: under ``torch.no_grad()``, where converting is
    often done as a copy of weights, it never does. Those parameters decide instead, as they
    do in a forward.
    """
    plist = getattr(getattr(module, "parametrizations", None), name, None)
    if plist is not None:
        return any(p.requires_grad for p in plist.parameters())
    return value.requires_grad


def _requires_grad(lin: nn.Module) -> dict:
    return {n: _trains(lin, n, t) for n, t in (("weight", lin.weight), ("bias", lin.bias)) if t is not None}


def _read_current(module: nn.Module, name: str) -> torch.Tensor | None:
    """``module.<name>`` as the module's next forward computes it (a conversion's read).

    ``torch.nn.utils.prune`` and the old ``weight_norm`` / ``spectral_norm`` keep the tensor
    as a plain attribute that a forward pre-hook recomputes from their parameters
    (``weight_orig`` and the mask, ``weight_g`` and ``weight_v``): between an optimizer step
    and the next forward it still holds the value from before the step, and it requires grad
    only if the forward that set it recorded. The hook's own computation gives the current
    value; it runs with grad enabled, as in a training forward, so that whether the value
    requires grad follows those parameters. Hooks run in order and the last one to set the
    name wins, so the last matching one is used.
    """
    value = getattr(module, name)
    # Not imported here: unimported, no module was pruned (and importing it costs).
    prune = sys.modules.get("torch.nn.utils.prune")
    for hook in module._forward_pre_hooks.values():
        with torch.enable_grad():
            if prune is not None and isinstance(hook, prune.BasePruningMethod) and hook._tensor_name == name:
                value = hook.apply_mask(module)
            elif isinstance(hook, _WeightNorm) and hook.name == name:
                value = hook.compute_weight(module)
            elif isinstance(hook, _SpectralNorm) and hook.name == name:
                # As its hook does in a forward: one power iteration in training mode.
                value = hook.compute_weight(module, do_power_iteration=module.training)
    return value


def _planned_operand(module: nn.Module, name: str) -> torch.Tensor | None:
    """``module.<name>`` as a plan reads it: the shape, dtype, device and ``requires_grad`` the
    next forward's value has, without computing that value.

    A plan reads no data, but reading a parametrized tensor runs its parametrization
    (``spectral_norm`` steps its power iteration in training, a random one draws), so the
    parametrization's ``original`` stands in (of the same shape and dtype, which torch checks
    where it is not registered ``unsafe``), requiring grad where any of its parameters does.
    ``torch.nn.utils.prune`` and the old ``weight_norm`` / ``spectral_norm`` keep the value
    their pre-hook computed at the last forward, which requires grad only if that forward
    recorded: whether the next one records follows the hook's parameters.
    """
    plist = module._modules.get("parametrizations")
    if plist is not None and name in plist._modules:
        chain = plist._modules[name]
        orig = chain._parameters.get("original")
        # torch keeps a parametrization's shape and dtype those of the original, unless it was
        # registered with unsafe=True: that one is computed, as the forward computes it.
        if isinstance(orig, torch.Tensor) and orig.is_floating_point() and not getattr(chain, "unsafe", True):
            return orig.detach().requires_grad_(any(t.requires_grad for t in chain.parameters()))
        return getattr(module, name)
    value = getattr(module, name)
    sources: tuple = ()
    prune = sys.modules.get("torch.nn.utils.prune")
    for hook in module._forward_pre_hooks.values():
        if prune is not None and isinstance(hook, prune.BasePruningMethod) and hook._tensor_name == name:
            sources = (name + "_orig",)
        elif isinstance(hook, _WeightNorm) and hook.name == name:
            sources = (name + "_g", name + "_v")
        elif isinstance(hook, _SpectralNorm) and hook.name == name:
            sources = (name + "_orig",)
    params = [module._parameters.get(src) for src in sources]
    if params and isinstance(value, torch.Tensor) and value.is_floating_point() \
            and all(isinstance(t, torch.Tensor) for t in params):
        return value.detach().requires_grad_(any(t.requires_grad for t in params))
    return value


def _copy_state(src: nn.Module, dst: nn.Module, read: tuple | None = None) -> None:
    """``src``'s training flag and its parameters' ``requires_grad`` onto ``dst`` (a conversion's copy).

    ``read``: ``(weight, bias)`` as the caller already read them from ``src`` (with grad
    enabled), so that a parametrized weight is not computed again.
    """
    dst.training = src.training
    # Only where it differs: requires_grad_ is refused inside a torch.func transform, where
    # a conversion may run (a reference model built from heads inside jvp).
    weight, bias = (src.weight, src.bias) if read is None else read
    for name, a, b in (("weight", weight, dst.weight), ("bias", bias, dst.bias)):
        if a is not None and _trains(src, name, a) != b.requires_grad:
            b.requires_grad_(_trains(src, name, a))


def _check_operands(
    fn: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cast_to: torch.dtype | None = None
) -> tuple[int, int, int]:
    """Check the operands' shapes, devices and dtypes (no batch size read); ``(G, out, in)``.

    With ``cast_to`` (an export under autocast, see :func:`_autocast`), the dtypes must agree
    once autocast has cast them to it, as the ops' autocast kernels will where the program runs.
    """
    check_operand_kinds(fn, input=x, weight=weight, bias=bias)
    # The messages are built only on failure: under torch.jit.trace the sizes are traced
    # tensors, and formatting them on every call printed them, a TracerWarning per element.
    if weight.dim() != 3:
        raise BlockDiagError(f"{fn}: weight must be [groups, block_out, block_in], "
                             f"got shape {tuple(weight.shape)}")
    g, o, i = weight.shape
    if not g >= 1:
        raise BlockDiagError(f"{fn}: weight must hold at least one group, "
                             f"got shape {tuple(weight.shape)} (groups=0)")
    if x.dim() < 1:
        raise BlockDiagError(f"{fn}: input must have at least 1 dimension, "
                             f"got a scalar of shape {tuple(x.shape)}")
    if not x.shape[-1] == g * i:
        raise BlockDiagError(f"{fn}: input has shape {tuple(x.shape)}; its last dimension must be "
                             f"in_features={g * i} (groups={g} x block_in={i})")
    if bias is not None and not tuple(bias.shape) == (g * o,):
        raise BlockDiagError(f"{fn}: bias must have shape ({g * o},), got {tuple(bias.shape)}")
    if cast_to is None:
        check_same_device_dtype(fn, input=x, weight=weight, bias=bias)
        return g, o, i
    named = [(k, t) for k, t in (("input", x), ("weight", weight), ("bias", bias)) if t is not None]
    k0, t0 = named[0]
    for k, t in named[1:]:
        if t.device != t0.device:
            check_same_device_dtype(fn, **dict(named))  # says which device, as outside an export
        d, d0 = _autocast_dtype(t, cast_to), _autocast_dtype(t0, cast_to)
        check(fn, d == d0, f"{k} has dtype {t.dtype} but {k0} has dtype {t0.dtype}, {d} and {d0} under "
                           f"autocast; cast them to one dtype")
    return g, o, i


def _autocast_dtype(t: torch.Tensor, dt: torch.dtype) -> torch.dtype:
    """The dtype autocast to ``dt`` casts ``t`` to (see :func:`_autocast`)."""
    return dt if t.is_floating_point() and t.dtype not in AUTOCAST_KEEPS else t.dtype


def _problem(fn: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Problem:
    g, o, i = _check_operands(fn, x, weight, bias)
    # A dtype no backend runs anywhere (integer, bool, complex, float8), said in the caller's
    # name: auto's planner would list every backend's refusal under "choose:". Only here, on
    # a plan-cache miss: the check costs microseconds, too much for the ops' per-call path.
    check_dtype(fn, x.dtype, "input dtype")
    # Rows are the leading dimensions' product, also when a block has no columns (numel 0).
    n = x.shape[:-1].numel()
    return Problem(n, g, i, o, x.dtype, x.device.type, _records_grad(x, weight, bias))


def _records_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether autograd records this product (then the backward's cost counts too)."""
    return torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )


# One C call that answers "is autocast on for any device?": the common answer (no) then
# costs ~0.05 us instead of ~0.8 us for the per-device queries below. It is private API, so
# it is optional: without it the per-device queries alone decide.
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


# Autocast's own rule, as data: it casts floating-point operands to its dtype except these
# (torch's autocast leaves float64 alone), so a float64 layer stays float64 under it too.
AUTOCAST_KEEPS = frozenset({torch.float64})


def _autocast(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under autocast, cast the operands as autocast casts ``F.linear``'s: to its dtype.

    Doing it before planning makes the output dtype the same whatever backend runs (torch
    autocasts bmm and conv but not its sparse products) and lets a low-precision input
    meet float32 parameters, as with ``nn.Linear``.
    """
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return x, weight, bias
    if fx_tracer(x, weight, bias) is not None:
        # torch.fx.symbolic_trace: the recorded call is cast when the traced module runs, under
        # the autocast in force then (a Proxy has no dtype to decide with now).
        return x, weight, bias
    dev = x.device.type
    if not (torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)):
        return x, weight, bias
    if _export_records_uncast():
        return x, weight, bias
    dt = torch.get_autocast_dtype(dev)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not t.is_floating_point() or t.dtype == dt or t.dtype in AUTOCAST_KEEPS:
            return t
        return t.to(dt)

    return cast(x), cast(weight), cast(bias)


def _export_records_uncast() -> bool:
    """Whether the layers leave autocast's casts to the ops: while non-strict ``torch.export`` traces.

    It records torch's ops above autocast (``nn.Linear``'s ``aten.linear`` uncast), and the
    program casts under the autocast in force where it runs, as the ops' autocast kernels do
    for ours. Cast in Python, the autocast of the export was baked into the program, which
    run without autocast returned bfloat16 and handed a following ``nn.Linear`` a bfloat16
    input. Strict export (dynamo) keeps the casts: there an autocast block inside the model
    cannot be told from one around the export, and torch's strict export of such a block
    fails for ``nn.Linear`` ("Tensor dtype mismatch"), where the recorded casts keep it working.
    """
    return torch.compiler.is_exporting() and not torch.compiler.is_dynamo_compiling()


def _export_autocast(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts ``x``'s device's products to where the export records them uncast, else None.

    There the operands reach the ops uncast (see :func:`_export_records_uncast`), and the ops cast them.
    """
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return None
    dev = x.device.type
    if not (torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)):
        return None
    if not _export_records_uncast():
        return None
    return torch.get_autocast_dtype(dev)


def _run_cast(name: str, operands: tuple, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Run backend ``name`` where autocast cast some of ``operands`` to ``x, w, b`` (:func:`_autocast`).

    Where the backend computes autocast's dtype in float32 anyway (``Backend.upcasts``:
    ``simd`` on CPU), the product runs on the operands as they were, in float32, and only its
    result is cast to autocast's dtype: autocast's casts down and the backend's casts up would
    cost two passes over the weight and the input for nothing but a rounding of both. The
    values are then those of the unrounded operands, rounded once (``nn.Linear`` under
    autocast multiplies the rounded ones).
    """
    dev = x.device.type
    if x.dtype not in get(name).upcasts.get(dev, ()):
        return _run(name, x, w, b)
    up = tuple(None if t is None else t.float() for t in operands)
    with torch.autocast(dev, enabled=False):
        return _run(name, *up).to(x.dtype)


def _refuse_autocast_dtype(fn: str, backend: str, operands: tuple, cast: tuple) -> None:
    """After a product failed: where autocast cast ``operands`` to ``cast`` (:func:`_autocast`),
    in a dtype the named backend does not run, raise the error that says so.

    The backend's own refusal names only the dtype autocast made ("does not support bfloat16
    on cpu (supports float32, float64)"), which a float32 model was never given.
    """
    changed = [(a, b) for a, b in zip(operands, cast) if a is not b]
    if backend == "auto" or not changed or backend not in _backend_names():
        return
    was, now = changed[0][0].dtype, changed[0][1].dtype
    dev = changed[0][1].device.type
    entry = get(backend)
    runs = entry.dtypes.get(dev, ())
    if now in runs or was not in runs or entry.unavailable_reason():
        return  # the refusal has another cause (the device, the dtype given, an unavailable backend)
    was, now = str(was).replace("torch.", ""), str(now).replace("torch.", "")
    raise BlockDiagError(
        f"{fn}: backend {backend!r} does not run {now} on {dev}, the dtype autocast cast the {was} "
        f"operands to (torch.autocast({dev!r}, dtype=torch.{now})); use backend='auto' or one that "
        f"runs {now}, or run the layer outside autocast (torch.autocast({dev!r}, enabled=False))"
    )


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Functional form: ``y[..., g-th slice] = x[..., g-th slice] @ weight[g].T + bias[g-th slice]``.

    >>> x, w = torch.randn(5, 6), torch.randn(3, 4, 2)
    >>> grouped_linear(x, w, backend="bmm").shape
    torch.Size([5, 12])

    Args:
        x: ``[..., groups * block_in]``.
        weight: ``[groups, block_out, block_in]``.
        bias: ``[groups * block_out]`` or None.
        backend: a registered backend name or ``"auto"``.

    Returns:
        ``[..., groups * block_out]``.

    Raises:
        BlockDiagError: on mismatched shapes, devices or dtypes, an unknown backend, or a
            backend that cannot run this input.
    """
    x0, w0, b0 = x, weight, bias
    x, weight, bias = _autocast(x, weight, bias)
    if plain_eager(x, weight, bias):
        try:
            name = _select("grouped_linear", backend, x, weight, bias)
            if x is x0 and weight is w0 and bias is b0:
                return _run(name, x, weight, bias)
            return _run_cast(name, (x0, w0, b0), x, weight, bias)
        except Exception:
            _explain_failure("grouped_linear", x, weight, bias)
            _refuse_autocast_dtype("grouped_linear", backend, (x0, w0, b0), (x, weight, bias))
            raise
    return _run_op("grouped_linear", backend, x, weight, bias)


# The per-call fast path, in front of the one plan cache (``dispatch.cached_plan``, keyed by
# backend, Problem and epoch). Everything the choice depends on is in the key: the shapes,
# dtypes and devices of all three operands (so validity, too, is a function of the key: only
# inputs that passed the checks are ever stored), whether autograd records, and the epoch
# (``blockdiag.dispatch.epoch``: for ``auto`` all of it, read on every call; for a named
# backend only its ``generation``, which a registry change moves). An entry is never
# checked, only looked up: whatever could make it stale moves the epoch. A hit skips the
# checks, building the Problem and the plan cache's lookup, which together cost as much as a
# small product.
_SELECTED: dict = {}


def _select(fn: str, backend: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The backend name to run for these operands (checked and planned on a miss)."""
    # _records_grad, inlined: this runs on every call. A non-tensor operand fails here;
    # the try costs nothing until then.
    try:
        grad = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
    except AttributeError:
        check_operand_kinds(fn, input=x, weight=weight, bias=bias)
        raise
    auto = backend == "auto"
    ep = _settings.epoch() if auto else _settings.generation
    # One flat tuple: each nested one would be built and hashed again on every call. Two
    # literals, not one plus ``key += (bias...)``: the concatenation costs 60-100 ns a call.
    if bias is None:
        key = (backend, x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device, grad, ep)
    else:
        key = (backend, x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device, grad, ep,
               bias.shape, bias.dtype, bias.device)
    try:
        name = _SELECTED.get(key)
    except TypeError:  # an unhashable backend (a list): get() names it and the valid names
        get(backend, fn)
        raise
    if name is not None:
        return name
    name = plan_for(backend, _problem(fn, x, weight, bias), fn).backend
    # Kept only if the epoch did not move while planning (the plan may be of the new one).
    if ep == (_settings.epoch() if auto else _settings.generation):
        if len(_SELECTED) > 4096:
            _SELECTED.clear()
        _SELECTED[key] = name
    return name


def _explain_failure(fn: str, x, weight, bias) -> None:
    """After the fast path raised: raise the clear error instead if an operand is the cause.

    The fast path checks only on a plan-cache miss, and its key holds shapes, not layouts, so
    a sparse or nested operand (or a non-tensor) can fail inside a kernel first. A ``try``
    costs nothing until it raises, so the per-call path stays as it is.
    """
    check_operand_kinds(fn, input=x, weight=weight, bias=bias)


def refuse_replaced_shapes(fn: str, layer: "GroupedLinear", weight, bias, where: str) -> None:
    """After a product failed: raise the clear error if ``weight`` or ``bias`` (as ``layer``
    read them) has another shape than the layer's.

    ``GroupedLinear.__setattr__`` refuses such a replacement, but ``torch.func.functional_call``
    puts its tensors into the parameter dict directly, and ``weight.data = ...`` changes the
    parameter in place: the ops then took the groups from the weight and blamed the input
    ("its last dimension must be in_features=10") or the bias, or torch's own view and
    broadcast errors named nothing. Only run where something already failed: it costs the
    per-call path nothing.
    """
    want = {"weight": (layer.groups, layer.block_out, layer.block_in), "bias": (layer.out_features,)}
    for name, t in (("weight", weight), ("bias", bias)):
        if isinstance(t, torch.Tensor) and tuple(t.shape) != want[name]:
            raise BlockDiagError(
                f"{fn}: {where}{name} has shape {tuple(t.shape)}, but the layer's {name} has shape "
                f"{want[name]} (groups={layer.groups}, block {layer.block_in}x{layer.block_out}, in x out): "
                "a tensor of another shape was put in its place (torch.func.functional_call, "
                f"{name}.data = ...); pass one of the layer's shape, or make a new layer for another"
            )


def _run(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The caller checked plain_eager: an op entry's eager route runs without checking again.
    fn = get(name).fn
    if type(fn) is OpEntry:
        fn = fn.eager
    else:
        fn = functools.partial(_run_registered, name, fn)
    if x.dim() == 2:
        return fn(x, weight, bias)
    g, o, i = weight.shape
    lead = x.shape[:-1]
    # The row count, not -1: reshape cannot infer it when a block has no columns.
    y = fn(x.reshape(lead.numel(), g * i), weight, bias)
    return y.reshape(*lead, g * o)


def _run_registered(name: str, fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A registered plain function (no op of ours around it), its result checked."""
    return check_result(name, fn(x, weight, bias), x, weight, bias, _records_grad(x, weight, bias))


def _compile_guard(generation: int, config_key: int) -> None:
    """Nothing at run time; under dynamo, reading the arguments makes them guards of the graph.

    ``generation``: :data:`blockdiag.settings.generation`; ``config_key``: the calling
    thread's stack of ``blockdiag.config`` blocks (``settings._local.key``), which dynamo
    guards per call like any attribute it read.
    """
    if generation < 0 or config_key < 0:
        raise AssertionError((generation, config_key))


def _traced_plan_state(native: bool = True, dtype: torch.dtype | None = None, device_type: str = "cpu") -> str:
    """:func:`blockdiag.dispatch.plan_state`, which dynamo calls once and records as a constant.

    With ``native``, under ``torch.compile`` (not ``torch.export``), followed by the native
    routes ready now for ``dtype`` on ``device_type``, made ready first where they can be
    (:func:`blockdiag.ops.auto.traced_routes`): the graph may then record a C++ backend's
    ops, whether or not an eager call came first.
    """
    routes = traced_routes(dtype, device_type) if native else ""
    return f"{plan_state()} {routes}" if routes else plan_state()


# What torch.compiler.assume_constant_result sets (all it does), set here without it: the
# decorator imports torch._dynamo, which loads DTensor, and importing blockdiag must not.
# tests/test_transforms.py checks that the decorator still does just this.
_traced_plan_state._dynamo_marked_constant = True


def _onnx_exporting() -> bool:
    """Whether ``torch.onnx.export`` is tracing (either exporter); never imports ``torch.onnx``,
    whose import costs more than a product: unimported, no export runs."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


def _run_op(fn: str, backend: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product through the registered ops: traced graphs, transforms, modes and subclasses.

    Nothing here reads the batch size as a number, so a graph traced with a symbolic batch
    stays general: ``auto`` becomes the ``blockdiag::auto`` op, which plans per call at run
    time (see :mod:`blockdiag.ops.auto`), and a named backend's op checks at run time that
    the backend accepts the operands. Only the checks that need no data or batch run here.
    """
    tracer = fx_tracer(x, weight, bias)
    if tracer is not None:
        # torch.fx.symbolic_trace runs forward on Proxies, which hold no shape, dtype or value
        # to check or plan with (the checks below would call the input "not a torch.Tensor"):
        # the product is recorded as one call of the functional form, which the traced module
        # runs on its tensors, checked and planned per call as an eager call is.
        return tracer.create_proxy("call_function", grouped_linear, (x, weight, bias), {"backend": backend})
    check_operand_kinds(fn, input=x, weight=weight, bias=bias)
    if not torch.compiler.is_compiling() and not _sharding._done:
        # Registers DTensor's rules once DTensor is loaded; never traced (it takes a lock).
        # Asked in this order, dynamo never reads ``_done``: a graph guarded on it would
        # recompile once the rules are registered (DTensor loaded after compiling).
        _sharding.ensure()
    g, o, i = _check_operands(fn, x, weight, bias, _export_autocast(x))
    # The dtype check of the eager path (_problem), for meta and fake operands too, which
    # no kernel refuses, and said as there: a traced auto listed every backend's refusal
    # under "choose:". Only dtypes no backend may run (not floating point, or one byte:
    # float8) pay for the registry's look-up; this path runs per call for meta operands.
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        check_dtype(fn, x.dtype, "input dtype")
    lead = x.shape[:-1]
    # The product of the sizes, not torch.Size.numel(), which makes a symbolic batch a
    # constant (an export with a dynamic batch of a 3-D input failed); and compared with 0 as
    # a plain int only, which a traced empty batch is (torch specialises sizes 0 and 1).
    rows = math.prod(lead)
    empty_dtensor = type(rows) is int and rows == 0 and _sharding.is_dtensor(x)
    if x.dim() == 2:
        x2 = x
    else:
        x2 = _reshape_empty_dtensor(x, (0, g * i)) if empty_dtensor else x.reshape(rows, g * i)
    if _onnx_exporting():
        # ONNX has no blockdiag ops, and no backend's kernel means anything to an ONNX
        # runtime: every backend computes one function, recorded as one batched matmul in
        # torch ops, which both of torch's ONNX exporters translate.
        y = transform_forward(None)(x2, weight, bias)
    elif backend == "auto":
        # jit.trace records Python values as constants, and its check run repeats the call
        # under no_grad: a traced auto is planned for inference, whatever grad mode traced it.
        train = _records_grad(x, weight, bias) and torch._C._get_tracing_state() is None
        if torch.compiler.is_compiling():
            # Dynamo guards what it reads: a graph that planned when traced (auto_inline at a
            # concrete batch) recompiles when the generation moves (settings, profile, registry)
            # or the calling thread's config blocks differ.
            # The new graph must also differ from the old one, or torch's compile caches (keyed
            # by the graph) hand back the old plan: it carries the plan state's digest.
            _compile_guard(_settings.generation, _settings._local.key)
            # The C++ ops of a native route have no forward-mode rule: a graph traced, or run,
            # with forward AD active records none (reading the level makes it a guard).
            state = _traced_plan_state(_fwad._current_level < 0, x2.dtype, x2.device.type)
            y = _auto_inline_op(x2, weight, bias, train, state)
        else:
            y = _auto_op(x2, weight, bias, train)
    else:
        entry = get(backend, fn).fn
        if isinstance(entry, OpEntry):
            y = entry.call_op(x2, weight, bias)
        else:
            y = check_result(backend, entry(x2, weight, bias), x2, weight, bias, alias=False)
    if x.dim() == 2:
        return y
    if empty_dtensor and _sharding.is_dtensor(y):
        return _reshape_empty_dtensor(y, (*lead, g * o))
    return y.reshape(*lead, g * o)


def fx_tracer(*operands):
    """The ``torch.fx`` tracer whose ``Proxy`` one of ``operands`` is (``symbolic_trace``), or None."""
    if torch.compiler.is_compiling():  # first: dynamo folds it to a constant, and traces no Proxy
        return None
    fx = sys.modules.get("torch.fx")  # not imported here: unimported, nothing traces with it
    if fx is not None:
        for t in operands:
            if isinstance(t, fx.Proxy):
                return t.tracer
    return None


def _reshape_empty_dtensor(t, shape: tuple[int, ...]):
    """The empty DTensor ``t`` reshaped to ``shape``, rows to rows and columns to columns.

    DTensor's view rule fails on shapes with a zero (torch 2.13: "integer modulo by zero" for
    ``[2, 0, W]``, "cannot unflatten unevenly sharded" for ``[0, 3, W]`` split by columns),
    forward and backward, where a plain empty batch runs. An empty tensor holds no values, so
    it is rebuilt from its (empty) local shard: a shard of the last dimension stays on the last,
    a shard of a leading one goes to the first. ``to_local`` and ``from_local`` are
    differentiable, so the gradients still reach the parameters (as zeros, as for ``nn.Linear``).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = []
    for p in t.placements:
        if type(p) is Shard:
            placements.append(Shard(len(shape) - 1 if p.dim % t.dim() == t.dim() - 1 else 0))
        elif isinstance(p, (Replicate, Partial)):
            placements.append(p)
        else:  # a placement of torch's own making (strided shards): its rule's to read
            return t.reshape(shape)
    local, _ = compute_local_shape_and_global_offset(shape, t.device_mesh, placements)
    return DTensor.from_local(t.to_local().reshape(local), t.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=_sharding.contiguous_strides(shape))


def _reset_distributed(p, bound: float) -> None:
    """U(-bound, bound) into the DTensor ``p``: the whole tensor drawn here, this rank's shard kept."""
    from torch.distributed.tensor import DTensor, Replicate

    with torch.no_grad():
        whole = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device).uniform_(-bound, bound)
        mesh = p.device_mesh
        # Replicate -> any placement is a local slice on each rank: no communication.
        mine = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
        p.to_local().copy_(mine.redistribute(mesh, p.placements).to_local())


class GroupedLinear(nn.Module):
    """``groups`` independent ``nn.Linear(in_features // groups, out_features // groups)``.

    Block ``g`` maps input slice ``g`` to output slice ``g``, as ``nn.Conv1d(groups=...)``
    does; the layer equals ``nn.Linear`` with a block-diagonal weight.

    >>> layer = GroupedLinear(150 * 4, 10 * 4, groups=4)
    >>> layer(torch.randn(32, 600)).shape
    torch.Size([32, 40])
    >>> layer.weight.shape
    torch.Size([4, 10, 150])

    Args:
        in_features: total input features (``groups * block_in``).
        out_features: total output features (``groups * block_out``).
        groups: number of independent blocks; must divide both feature counts.
        bias: learn an additive bias (``[out_features]``).
        backend: a registered backend name or ``"auto"`` (settable later as ``layer.backend``).
        device: factory kwarg, as for ``nn.Linear``.
        dtype: factory kwarg, as for ``nn.Linear``.

    Raises:
        BlockDiagError: groups not dividing the features, or an unknown backend name.

    The parameters (``weight: [groups, block_out, block_in]``, ``bias: [out_features]``) and
    the state_dict are the same whatever the backend. Default init matches ``groups``
    independent ``nn.Linear(block_in, block_out)`` in distribution.
    """

    # Declared for type checkers: the constructor stores each as the int it checked.
    in_features: int
    out_features: int
    groups: int
    block_in: int
    block_out: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        groups: int,
        bias: bool = True,
        *,
        backend: str = "auto",
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        in_features, out_features, groups = as_size(in_features), as_size(out_features), as_size(groups)
        check_groups(type(self).__name__, groups, in_features, out_features)
        check_dtype(type(self).__name__, dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.groups = groups
        self.block_in = in_features // groups
        self.block_out = out_features // groups
        self.backend = backend
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(groups, self.block_out, self.block_in, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def __setattr__(self, name: str, value) -> None:
        # The ops take the group count from the weight: a replacement of another shape would
        # run as another layer while groups, the block sizes, the repr, reset_parameters and
        # to_linears kept this one's. (Sharding registers parameters of the same global shape.)
        if name in ("weight", "bias") and isinstance(value, torch.Tensor) and "block_in" in self.__dict__:
            want = (self.groups, self.block_out, self.block_in) if name == "weight" else (self.out_features,)
            check(f"{type(self).__name__}.{name}", tuple(value.shape) == want,
                  f"the replacement has shape {tuple(value.shape)}, but this layer's {name} has shape {want} "
                  f"(groups={self.groups}, block {self.block_in}x{self.block_out}); make a new layer for "
                  "another shape")
        super().__setattr__(name, value)

    @property
    def backend(self) -> str:
        """The backend name, or ``"auto"``; assigning an unknown name raises."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if name != "auto":
            get(name, f"{type(self).__name__}.backend")
        self._backend = name

    def reset_parameters(self) -> None:
        """As ``nn.Linear.reset_parameters`` per block: U(-1/sqrt(block_in), 1/sqrt(block_in)).

        A distributed parameter (a DTensor: group parallel, FSDP2) is drawn whole on every
        rank, from the default generator as a plain layer's would be, and each rank keeps its
        own shard: DTensor's random ops draw a shard from the rank's own generator on devices
        without its RNG tracker (CPU), so ranks seeded alike (as the guide asks) would draw the
        same values and the groups on different ranks would be copies of each other. With the
        same seed the result equals a plain layer's ``reset_parameters``.
        """
        bound = 1.0 / math.sqrt(self.block_in)
        # nn.Linear uses kaiming_uniform_(a=sqrt(5)), whose bound is exactly 1/sqrt(fan_in).
        for p in (self.weight, self.bias):
            if p is None:
                continue
            if _sharding.is_dtensor(p):
                _reset_distributed(p, bound)
            else:
                nn.init.uniform_(p, -bound, bound)

    def plan(self, x: torch.Tensor) -> Plan:
        """The backend this layer uses for ``x`` and why (print it for a report).

        >>> layer = GroupedLinear(20, 20, groups=2)
        >>> layer.plan(torch.randn(8, 20)).backend in [b.name for b in blockdiag.list_backends()]
        True

        Args:
            x: an input this layer would be called on (its shape, dtype, device and whether
                autograd records decide the plan; it is not computed with).

        Returns:
            the :class:`Plan`: for ``backend="auto"`` the one :func:`blockdiag.choose`
                gives, else the named backend with its reason.

        Raises:
            BlockDiagError: an input the layer cannot run (shape, dtype, device), or a named
                backend that declines it.
        """
        x0, w0, b0 = x, _planned_operand(self, "weight"), _planned_operand(self, "bias")
        x, w, b = _autocast(x0, w0, b0)
        try:
            return plan_for(self.backend, _problem(type(self).__name__, x, w, b), type(self).__name__)
        except BlockDiagError:
            _refuse_autocast_dtype(f"{type(self).__name__}.plan", self.backend, (x0, w0, b0), (x, w, b))
            raise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., groups * block_in] -> [..., groups * block_out]`` with this layer's backend.

        Raises:
            BlockDiagError: see :meth:`plan`.
        """
        # weight and bias are read once: a parametrized one is computed on every read (a
        # spectral_norm advances its power iteration, a random one draws again), and the
        # product must run on the one value read, as nn.Linear's does.
        x0, w0, b0 = x, self.weight, self.bias
        x, w, b = _autocast(x, w0, b0)
        if plain_eager(x, w, b):
            try:
                name = _select(type(self).__name__, self._backend, x, w, b)
                if x is x0 and w is w0 and b is b0:
                    return _run(name, x, w, b)
                return _run_cast(name, (x0, w0, b0), x, w, b)
            except Exception:
                _explain_failure(type(self).__name__, x, w, b)
                refuse_replaced_shapes(type(self).__name__, self, w0, b0, "")
                _refuse_autocast_dtype(type(self).__name__, self._backend, (x0, w0, b0), (x, w, b))
                raise
        if torch.compiler.is_compiling():  # no try in a traced frame: nothing to add while tracing
            return _run_op(type(self).__name__, self._backend, x, w, b)
        try:
            return _run_op(type(self).__name__, self._backend, x, w, b)
        except Exception:
            refuse_replaced_shapes(type(self).__name__, self, w0, b0, "")
            raise

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first: refuse with the reason instead of a TorchScript
        # parse error deep inside the library.
        raise BlockDiagError(
            f"{type(self).__name__}: torch.jit.script cannot compile blockdiag's layers (they choose "
            "and dispatch their kernels in Python); use torch.compile, torch.export or torch.jit.trace"
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"groups={self.groups}, block={self.block_in}x{self.block_out} (in x out), "
            f"bias={self.bias is not None}, backend={self.backend!r}"
        )


    @classmethod
    @computing_once
    def from_linears(
        cls, linears: Sequence[nn.Linear] | nn.ModuleList, *, backend: str = "auto"
    ) -> "GroupedLinear":
        """Stack ``G`` equal-shaped ``nn.Linear`` into one layer (weights and biases copied).

        >>> heads = [nn.Linear(3, 2) for _ in range(4)]
        >>> GroupedLinear.from_linears(heads).weight.shape
        torch.Size([4, 2, 3])

        Args:
            linears: a non-empty sequence of ``nn.Linear`` of one shape, all with or all
                without bias, on one device and dtype. A parametrized one (masked by
                ``mask_block_diagonal_``, ``parametrizations.weight_norm``, ``spectral_norm``)
                is copied as the weight it computes now; the parametrization is not carried
                over, so the layer trains that weight itself, and differs from the linears
                after a step (the FAQ shows per-group parametrizations to register on it).
            backend: for the new layer.

        Returns:
            a ``GroupedLinear`` on the linears' device and dtype, with new parameters (no
                gradient, optimizer state or attribute of the linears' comes along): build
                the optimizer after converting.

        Raises:
            BlockDiagError: empty input, non-Linear items, or differing shapes, bias,
                devices or dtypes.
        """
        fn = "GroupedLinear.from_linears"
        # One Linear passed where the sequence belongs would fail as "object is not iterable".
        check(fn, isinstance(linears, Iterable),
              f"linears must be a sequence of nn.Linear, got one {type(linears).__name__}; for a single "
              "layer pass [linear]")
        # A dict iterates its keys: its first "linear" was a str, with no word of the values.
        check(fn, not isinstance(linears, (Mapping, nn.ModuleDict)),
              f"linears is a {type(linears).__name__}, which iterates its keys; pass its values "
              "(list(linears.values()))")
        linears = list(linears)
        check(fn, len(linears) > 0, "linears is empty")
        first = linears[0]
        for k, lin in enumerate(linears):
            _sharding.refuse_sharded(fn, lin, f"linears[{k}].")
            check_plain_linear(fn, lin, f"linears[{k}]")
            check(
                fn,
                lin.weight.shape == first.weight.shape,
                f"linears[{k}] has weight shape {tuple(lin.weight.shape)} but linears[0] has "
                f"{tuple(first.weight.shape)}",
            )
            check(
                fn,
                (lin.bias is None) == (first.bias is None),
                f"linears[{k}] {'has no' if lin.bias is None else 'has a'} bias, unlike linears[0]",
            )
            check_same_device_dtype(fn, **{"linears[0].weight": first.weight, f"linears[{k}].weight": lin.weight})
            if lin.bias is not None:
                # A bias in another dtype would be cast silently by the copy below: not lossless.
                check_same_device_dtype(fn, **{"linears[0].weight": first.weight, f"linears[{k}].bias": lin.bias})
            frozen = _requires_grad(lin)
            check(fn, frozen == _requires_grad(first),
                  f"linears[{k}] has requires_grad {frozen} but linears[0] has {_requires_grad(first)}: "
                  "the grouped layer holds one parameter for every group")
        _refuse_shared_parameters(fn, [(f"linears[{k}]", lin) for k, lin in enumerate(linears)])
        g = len(linears)
        o, i = first.weight.shape
        # The layer's own refusal would name its totals (in_features=0, out_features=G * o),
        # which the caller never passed: name the linears' shape instead.
        check(fn, o >= 1 and i >= 1,
              f"linears[0] has weight shape {(o, i)} (nn.Linear({i}, {o})): a GroupedLinear block needs at "
              "least one input and one output feature")
        layer = cls(g * i, g * o, g, bias=first.bias is not None, backend=backend,
                    device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.stack([lin.weight for lin in linears]))
            if layer.bias is not None:
                layer.bias.copy_(torch.cat([lin.bias for lin in linears]))
        _copy_state(first, layer)
        return layer

    def to_linears(self) -> nn.ModuleList:
        """The ``groups`` independent ``nn.Linear`` this layer computes (weights copied).

        >>> GroupedLinear(6, 4, groups=2).to_linears()[0]
        Linear(in_features=3, out_features=2, bias=True)

        Returns:
            an ``nn.ModuleList`` of ``groups`` ``nn.Linear(block_in, block_out)`` on this
                layer's device and dtype; ``torch.cat([l(x_g) ...], -1)`` over the input's
                slices equals this layer's output. Hooks registered on this layer are not
                carried over: they see the whole layer's input and output, which no single
                ``nn.Linear`` has; register them again where they belong.
        """
        _sharding.refuse_sharded("GroupedLinear.to_linears", self)
        out = nn.ModuleList()
        # Read once: a parametrized weight is computed on every read (spectral_norm steps its
        # power iteration), and every head must come from the one value; a pruned one as the
        # next forward computes it, not the stale attribute of the last forward.
        weight, bias = _read_current(self, "weight"), _read_current(self, "bias")
        for g in range(self.groups):
            lin = nn.Linear(self.block_in, self.block_out, bias=bias is not None,
                            device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                lin.weight.copy_(weight[g])
                if bias is not None:
                    lin.bias.copy_(bias[g * self.block_out:(g + 1) * self.block_out])
            _copy_state(self, lin, (weight, bias))
            out.append(lin)
        return out


