"""The string-keyed backend registry and the data each backend declares about itself."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from .. import settings as _settings
from .._checks import as_size, is_int
from .._errors import BlockDiagError

__all__ = ["Problem", "Backend", "BackendInfo", "register", "replace", "unregister", "get", "names", "registry"]

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
F32_F64 = frozenset({torch.float32, torch.float64})


@dataclass(frozen=True)
class Problem:
    """One grouped-linear product: what a backend must run and what the chooser keys on.

    ``batch`` is the number of rows after flattening the leading dims.
    """

    batch: int
    groups: int
    block_in: int
    block_out: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    requires_grad: bool = False

    def __post_init__(self) -> None:
        # A Problem is the chooser's cache key and every backend's contract: a malformed one
        # must fail here, naming the field, not deep inside a ranking (groups=0 divided by
        # zero there) or with a message that reads like a support gap.
        for name, lo in (("batch", 0), ("groups", 1), ("block_in", 0), ("block_out", 0)):
            v = getattr(self, name)
            if not is_int(v, lo) or type(v) is not int:
                # A NumPy integer or an IntEnum is stored as the int it is (the cache key).
                v = as_size(v)
                if not is_int(v, lo):
                    raise BlockDiagError(f"Problem: {name} must be an int >= {lo}, got {getattr(self, name)!r}")
                object.__setattr__(self, name, int(v))
        if isinstance(self.device, str) and ":" in self.device:
            # "cuda:1" (a tensor's str(device)) names a device; the problem is its type's.
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except RuntimeError:
                raise BlockDiagError(f"Problem: device must be a device type such as 'cpu', got {self.device!r}") from None
        if isinstance(self.device, torch.device):
            # torch.device("cuda:1") and "cuda" are the same problem: keyed by device type.
            object.__setattr__(self, "device", self.device.type)
        if not isinstance(self.device, str) or not self.device.strip():
            # An empty one planned on: every backend then declined it "on  (runs on cpu, cuda)".
            raise BlockDiagError(f"Problem: device must be a device type such as 'cpu', got {self.device!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise BlockDiagError(f"Problem: dtype must be a torch.dtype, got {self.dtype!r}")
        if type(self.requires_grad) is not bool:
            # Read as a truth value, requires_grad="no" planned for training; a NumPy bool is
            # the bool it holds (stored as one: the problem is a cache key).
            if not _settings._numpy_bool(self.requires_grad):
                raise BlockDiagError(f"Problem: requires_grad must be True or False, got {self.requires_grad!r}")
            object.__setattr__(self, "requires_grad", bool(self.requires_grad))

    @property
    def sparsity(self) -> float:
        """Fraction of the block-diagonal matrix outside the blocks: ``1 - 1/groups``."""
        return 1.0 - 1.0 / self.groups

    @property
    def flops(self) -> int:
        """Useful multiply-adds times two of the forward product."""
        return 2 * self.batch * self.groups * self.block_in * self.block_out

    @property
    def dense_elements(self) -> int:
        """Entries of the dense ``[G*out, G*in]`` block-diagonal matrix (grows with ``groups**2``)."""
        return self.groups**2 * self.block_in * self.block_out

    @property
    def mode(self) -> str:
        """``"train"`` (forward and backward) or ``"forward"``."""
        return "train" if self.requires_grad else "forward"

    def describe(self) -> str:
        """The problem in one line, as plans and ``blockdiag explain`` head their reports.

        >>> import torch
        >>> Problem(256, 50, 150, 10, torch.float32, "cpu", True).describe()
        'batch=256 groups=50 block=150x10 (in x out) float32 cpu train'
        """
        return (
            f"batch={self.batch} groups={self.groups} block={self.block_in}x{self.block_out} "
            f"(in x out) {str(self.dtype).replace('torch.', '')} {self.device} {self.mode}"
        )


# fn(x [N, G*in], weight [G, out, in], bias [G*out] | None) -> [N, G*out]
KernelFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def _find_spec(module: str):
    """``importlib.util.find_spec(module)``, None where a parent package is missing too.

    For a dotted name find_spec imports the parents, and raises where one is not installed:
    a backend declaring ``requires="pkg.ext"`` then failed every plan of the process (every
    backend is asked) with ModuleNotFoundError, where it is only unavailable.
    """
    try:
        return importlib.util.find_spec(module)
    except ImportError:
        return None


@dataclass(frozen=True)
class Backend:
    """A multiply strategy and the constraints under which it runs, as data.

    Attributes:
        name: registry key.
        fn: the pure function ``fn(x, weight, bias) -> y`` with ``x: [N, G*in]``,
            ``weight: [G, out, in]``, ``bias: [G*out] | None``.
        dtypes: for each device type it runs on, the dtypes it accepts (required: registering
            a backend that declares none raises).
        grad: whether it gives gradients for input, weight and bias.
        sparse: whether it multiplies through a sparse layout (then ``auto`` considers it only
            above the sparsity threshold).
        dense_matrix: whether it materializes the dense ``[G*out, G*in]`` matrix (then
            ``auto`` considers it only up to ``dense_max_groups`` / ``dense_max_elements``,
            and ``tune`` skips it where that matrix would be huge).
        requires: an optional module it needs (imported lazily, only inside ``fn``).
        constraint: extra shape rules: returns the reason it declines a problem, or None.
        summary: one line for tables and docs.
        double_grad: whether its backward is itself differentiable (``create_graph=True``,
            gradient penalties, Hessian-vector products). A first-order backend refuses such
            a backward with :class:`BlockDiagError` instead of silently treating the
            gradient as a constant; under the ``double_backward`` setting ``auto`` does not
            choose it for training.
        probe: extra installation check beyond ``requires`` (a torch feature, a GPU
            generation): returns why the backend cannot run here at all, or None.
        same_forward_as: another backend whose forward this one runs unchanged (only the
            backward differs). Without autograd the two are the same computation, so
            ``auto`` ranks only the other one and ``tune``/``bench`` do not time this one;
            naming it explicitly still runs it.
        isolates_groups: whether a NaN/Inf in one group's input (or upstream gradient) stays
            in that group's output (input gradient). ``False`` (``dense``: ``0 * NaN`` is NaN)
            keeps ``auto`` off it unless a dense crossover is set explicitly (see
            :func:`blockdiag.dispatch.settings_exclusion`); naming it still runs it.
        loops_groups: whether it calls torch once per group from Python (``loop``'s
            backward, for instance): its time grows with the group count whatever the FLOPs,
            which the CLI's duration estimate counts.
        reduced_precision: for each device type, the dtypes it computes with less precision
            than ``nn.Linear`` does under torch's defaults, and why (``conv`` on CUDA:
            cuDNN runs float32 convolutions in TF32 unless
            ``torch.backends.cudnn.allow_tf32`` is off, where float32 matmuls stay float32).
            ``auto`` never picks it there; naming it still runs it.
        upcasts: for each device type, the dtypes it computes in float32 (``simd`` on CPU:
            bfloat16 and float16, cast up, run in its float32 kernels, each result rounded
            once). Where the table in use has no entry of that dtype, ``auto`` ranks such
            backends first (:data:`blockdiag.dispatch.UPCAST_RULE`): the other backends'
            float32 times say nothing of their half-precision kernels.
    """

    name: str
    fn: KernelFn
    dtypes: Mapping[str, frozenset] = field(default_factory=dict)
    grad: bool = True
    sparse: bool = False
    dense_matrix: bool = False
    requires: Optional[str] = None
    constraint: Optional[Callable[[Problem], Optional[str]]] = None
    summary: str = ""
    probe: Optional[Callable[[], Optional[str]]] = None
    double_grad: bool = True
    same_forward_as: Optional[str] = None
    isolates_groups: bool = True
    loops_groups: bool = False
    reduced_precision: Mapping[str, tuple[frozenset, str]] = field(default_factory=dict)
    upcasts: Mapping[str, frozenset] = field(default_factory=dict)

    def unavailable_reason(self) -> Optional[str]:
        """Why this backend cannot run in this installation at all, or None."""
        if self.requires and _find_spec(self.requires) is None:
            return f"{self.requires.replace('_', '-')} is not installed"
        if self.probe is not None:
            return self._hook("probe", self.probe)
        return None

    def _hook(self, what: str, hook: Callable, *args) -> Optional[str]:
        """``hook(*args)``, a declared ``probe`` or ``constraint``: a reason string or None.

        Every plan asks every registered backend, so a hook that raises (or answers ``False``
        for "no objection") would otherwise surface in every ``auto`` call of the process as
        an error that names no backend, or silently keep this backend from running.
        """
        try:
            why = hook(*args)
        except Exception as e:
            at = f" for {args[0].describe()}" if args else ""
            raise BlockDiagError(f"backend {self.name!r}: its {what} raised {type(e).__name__}: {e}{at}") from e
        if why is not None and not isinstance(why, str):
            raise BlockDiagError(
                f"backend {self.name!r}: its {what} must return a reason string or None, got {why!r}"
            )
        return why or None

    def decline_reason(self, p: Problem) -> Optional[str]:
        """Why this backend cannot run ``p``, or None when it can."""
        # The device first: it is a static fact, true whatever is installed.
        if p.device not in self.dtypes:
            return f"does not run on {p.device} (runs on {', '.join(sorted(self.dtypes))})"
        why = self.unavailable_reason()
        if why:
            return f"unavailable: {why}"
        if p.dtype not in self.dtypes[p.device]:
            ok = ", ".join(sorted(str(d).replace("torch.", "") for d in self.dtypes[p.device]))
            return f"does not support {str(p.dtype).replace('torch.', '')} on {p.device} (supports {ok})"
        if p.requires_grad and not self.grad:
            return "has no backward"
        if self.constraint is not None:
            return self._hook("constraint", self.constraint, p)
        return None


@dataclass(frozen=True)
class BackendInfo:
    """What :func:`blockdiag.list_backends` reports for one backend: name, availability, why not, summary."""

    name: str
    available: bool
    reason: str
    summary: str

    def __str__(self) -> str:
        state = "available" if self.available else f"unavailable ({self.reason})"
        return f"{self.name:13s} {state:40s} {self.summary}"


class _Registry(dict):
    """The registry's mapping: every change to it starts a new chooser epoch.

    A plan depends on which backends are registered and on what each declares, so adding,
    replacing (also under the same name, as tests' spies do with ``monkeypatch.setitem``)
    or removing one must reach every cached plan (:func:`blockdiag.dispatch.epoch`). A
    ``dict`` subclass, so lookups (``get``, on every call) stay C-speed; each mutating
    method bumps the epoch after the change.
    """

    __slots__ = ()

    def __setitem__(self, name, backend):
        super().__setitem__(name, backend)
        _settings.bump_epoch()

    def __delitem__(self, name):
        super().__delitem__(name)
        _settings.bump_epoch()

    def __ior__(self, other):
        super().__ior__(other)
        _settings.bump_epoch()
        return self

    def pop(self, *args):
        try:
            return super().pop(*args)
        finally:
            _settings.bump_epoch()

    def popitem(self):
        try:
            return super().popitem()
        finally:
            _settings.bump_epoch()

    def setdefault(self, name, backend=None):
        try:
            return super().setdefault(name, backend)
        finally:
            _settings.bump_epoch()

    def update(self, *args, **kwargs):
        try:
            super().update(*args, **kwargs)
        finally:
            _settings.bump_epoch()

    def clear(self):
        super().clear()
        _settings.bump_epoch()


_REGISTRY: dict[str, Backend] = _Registry()


def _check_same_forward(fn_name: str, backend: Backend) -> None:
    if backend.same_forward_as == backend.name:
        raise BlockDiagError(f"{fn_name}: {backend.name!r} declares same_forward_as itself")
    if backend.same_forward_as is not None and backend.same_forward_as not in _REGISTRY:
        raise BlockDiagError(
            f"{fn_name}: {backend.name!r} declares same_forward_as={backend.same_forward_as!r}, "
            "which is not registered (register that backend first)"
        )


def _check_dtypes(fn_name: str, backend: Backend) -> None:
    """Refuse a ``dtypes`` declaration that is not ``{device type: set of torch.dtype}``.

    The chooser reads it for every backend on every plan: a malformed one (a flat set of
    dtypes, ``torch.device`` keys, dtype names as strings) would fail there, inside every
    ``auto`` call of the process, or silently keep the backend from ever matching.
    """
    d = backend.dtypes
    where = f"{fn_name}: backend {backend.name!r}: dtypes"
    shape = "a mapping {device type: set of torch.dtype}, e.g. {'cpu': frozenset({torch.float32})}"
    if not isinstance(d, Mapping):
        raise BlockDiagError(f"{where} must be {shape}, got {d!r}")
    if not d:
        # The default: such a backend ran nowhere, and naming it said only "does not run on
        # cpu (runs on )".
        raise BlockDiagError(f"{where} declares no device type, so it would never run: pass {shape}, got {d!r}")
    for dev, ds in d.items():
        if not isinstance(dev, str) or not dev or ":" in dev:
            raise BlockDiagError(f"{where}: keys must be device types such as 'cpu' or 'cuda', got {dev!r}")
        if isinstance(ds, (str, torch.dtype)) or not isinstance(ds, (set, frozenset, tuple, list)) \
                or not all(isinstance(t, torch.dtype) for t in ds):
            raise BlockDiagError(f"{where}[{dev!r}] must be a set of torch.dtype, got {ds!r}")
        if not ds:
            raise BlockDiagError(f"{where}[{dev!r}] is empty: the backend would never run on {dev}")


# The declared flags: a non-bool (``grad="no"``, truthy) would be read as its truth value.
_FLAGS = ("grad", "sparse", "dense_matrix", "double_grad", "isolates_groups", "loops_groups")


def _check_fields(fn_name: str, backend: Backend) -> None:
    """Refuse a declaration of another shape than the fields' documented ones.

    The chooser reads ``requires``, ``reduced_precision`` and ``upcasts`` of every backend
    on every plan: a malformed one (``reduced_precision=None``, a flat set of dtypes,
    ``requires=3``) failed there, inside every ``auto`` call of the process, with an
    AttributeError or TypeError that named no backend. The flags are read as truth values,
    so ``grad="no"`` declared a backward.
    """
    where = f"{fn_name}: backend {backend.name!r}"
    for flag in _FLAGS:
        v = getattr(backend, flag)
        if not isinstance(v, bool):
            raise BlockDiagError(f"{where}: {flag} must be True or False, got {v!r}")
    for name in ("requires", "same_forward_as"):
        v = getattr(backend, name)
        if v is not None and (not isinstance(v, str) or not v):
            raise BlockDiagError(f"{where}: {name} must be a non-empty str or None, got {v!r}")
    if backend.requires is not None and not all(part.isidentifier() for part in backend.requires.split(".")):
        raise BlockDiagError(
            f"{where}: requires must name a module (such as 'scipy' or 'pkg.ext'), got {backend.requires!r}")
    if not isinstance(backend.summary, str):
        raise BlockDiagError(f"{where}: summary must be a str, got {backend.summary!r}")
    for name in ("constraint", "probe"):
        v = getattr(backend, name)
        if v is not None and not callable(v):
            raise BlockDiagError(f"{where}: {name} must be callable or None, got {v!r}")
    for name, value_shape in (("upcasts", "a set of torch.dtype"),
                              ("reduced_precision", "a (set of torch.dtype, reason str) pair")):
        d = getattr(backend, name)
        shape = f"a mapping {{device type: {value_shape}}}"
        if not isinstance(d, Mapping):
            raise BlockDiagError(f"{where}: {name} must be {shape}, got {d!r}")
        for dev, v in d.items():
            if not isinstance(dev, str) or not dev or ":" in dev:
                raise BlockDiagError(f"{where}: {name}: keys must be device types such as 'cpu' or 'cuda', got {dev!r}")
            ds = v
            if name == "reduced_precision":
                if not isinstance(v, tuple) or len(v) != 2 or not isinstance(v[1], str):
                    raise BlockDiagError(f"{where}: {name}[{dev!r}] must be {value_shape}, got {v!r}")
                ds = v[0]
            if not isinstance(ds, (set, frozenset, tuple, list)) or not all(isinstance(t, torch.dtype) for t in ds):
                raise BlockDiagError(f"{where}: {name}[{dev!r}] must be {value_shape}, got {v!r}")


def register(backend: Backend) -> Backend:
    """Add a backend; a duplicate name raises :class:`BlockDiagError` (see :func:`replace`)."""
    if backend.name == "auto":
        raise BlockDiagError("register: 'auto' is reserved (backend='auto' asks the chooser); name the backend otherwise")
    if backend.name in _REGISTRY:
        raise BlockDiagError(f"register: a backend named {backend.name!r} is already registered")
    _check_fields("register", backend)
    _check_same_forward("register", backend)
    _check_dtypes("register", backend)
    _REGISTRY[backend.name] = backend
    return backend


def replace(backend: Backend) -> Backend:
    """Put ``backend`` in the place of the registered backend of the same name.

    It keeps its place in the registration order, and every plan cached before is stale
    from then on (a new epoch). Pass the returned backend to ``replace`` to undo.

    Returns:
        the backend it replaced.

    Raises:
        BlockDiagError: no backend of that name is registered (use :func:`register`), or
            its ``same_forward_as`` names an unregistered backend.
    """
    old = get(backend.name, "replace", auto_valid=False)
    _check_fields("replace", backend)
    _check_same_forward("replace", backend)
    _check_dtypes("replace", backend)
    _REGISTRY[backend.name] = backend
    return old


def unregister(name: str) -> Backend:
    """Remove the backend registered as ``name`` (a new epoch); returns it.

    Raises:
        BlockDiagError: unknown name, or another backend declares ``same_forward_as=name``
            (remove that one first).
    """
    old = get(name, "unregister", auto_valid=False)
    users = [b.name for b in _REGISTRY.values() if b.same_forward_as == name]
    if users:
        raise BlockDiagError(
            f"unregister: {', '.join(map(repr, users))} declare same_forward_as={name!r}; unregister them first"
        )
    del _REGISTRY[name]
    return old


def check_new_tensor(name: str, y, *operands):
    """``y``, what backend ``name``'s plain function returned, refused if it shares an operand's memory.

    ``nn.Linear`` and every built-in backend return a new tensor, and the ops that run a
    registered function inside graphs (``blockdiag::auto``) declare one, so AOTAutograd and
    inductor plan on it: an in-place op on a result that is ``x`` itself (an identity-like
    block) or a view of the weight would reach the operand in one run and not in another.
    Eager calls check it too, so the function fails where it was written, not once compiled.
    """
    if isinstance(y, torch.Tensor) and y.numel():
        ptr = y.untyped_storage().data_ptr()
        for label, t in zip(("input", "weight", "bias"), operands):
            if t is not None and t.numel() and t.untyped_storage().data_ptr() == ptr:
                raise BlockDiagError(
                    f"backend {name!r}: fn returned a tensor sharing memory with its {label} (the "
                    f"{label} itself or a view of it); return a new tensor, e.g. {label}.clone()"
                )
    return y


def check_result(name: str, y, x: torch.Tensor, weight: torch.Tensor, bias, grad: bool = False,
                 alias: bool = True):
    """``y``, what backend ``name``'s plain function returned for 2-D ``x``, once checked.

    A built-in backend's kernels are tested; a registered function is the user's, and what
    it returns goes straight to the caller (or, inside a graph, out of an op whose fake
    kernel promised ``[N, G*out]`` of the input's dtype). A wrong shape, dtype or device
    would surface later, far from the backend, or not at all. ``grad``: autograd records
    the product, so ``y`` must lead back to the operands; one detached from them (made under
    ``no_grad``, a reused buffer, ``.detach()``) would silently leave them without gradients.
    ``alias``: refuse a result sharing an operand's memory (:func:`check_new_tensor`); only
    where the tensors have storage (not while tracing, where the function is ordinary torch
    code whose aliasing torch follows).
    """
    g, o, _ = weight.shape
    want = (x.shape[0], g * o)
    if (not isinstance(y, torch.Tensor) or y.layout != torch.strided or tuple(y.shape) != want or y.dtype != x.dtype
            or y.device != x.device):
        got = (f"a {str(y.layout).removeprefix('torch.')} tensor of shape {tuple(y.shape)}, {y.dtype}, on {y.device}"
               if isinstance(y, torch.Tensor) else f"a {type(y).__name__}")
        raise BlockDiagError(
            f"backend {name!r}: fn returned {got}; it must return a strided y of shape {want} ([N, G*out]), "
            f"{x.dtype}, on {x.device} (the input's dtype and device)"
        )
    if grad and y.grad_fn is None and not any(y is t for t in (x, weight, bias)):
        raise BlockDiagError(
            f"backend {name!r}: fn returned a tensor that does not lead back to its operands (no grad_fn: "
            "detached, made under torch.no_grad, or written into a buffer), so they would get no gradient; "
            "write fn in differentiable torch operations, or declare grad=False"
        )
    return check_new_tensor(name, y, x, weight, bias) if alias else y


def names() -> tuple[str, ...]:
    """Registered backend names, in registration order."""
    return tuple(_REGISTRY)


def get(name: str, fn_name: str = "backend", auto_valid: bool = True) -> Backend:
    """The backend registered as ``name``; an unknown name lists the valid ones.

    ``auto_valid`` says whether the caller also accepts ``"auto"`` (a layer's backend
    does; a list of backends to time does not), so that the message lists what is valid
    where the name was given.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        valid = ", ".join(repr(n) for n in _REGISTRY)
        if auto_valid:
            valid = "'auto', " + valid
        elif name == "auto":
            raise BlockDiagError(
                f"{fn_name}: 'auto' is the choice among the backends, not one to list here; "
                f"valid names are {valid}"
            ) from None
        raise BlockDiagError(f"{fn_name}: unknown backend {name!r}; valid names are {valid}") from None


def check_dtype(fn_name: str, dtype, what: str = "dtype") -> None:
    """Refuse a dtype that no registered backend runs on any device (``None``: torch's default).

    A layer of such a dtype would construct and then fail at its first call, after the user
    had built the model around it. Which backend runs where is decided per call. ``what``
    names the dtype in the message (``"input dtype"`` for an operand's).
    """
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise BlockDiagError(f"{fn_name}: dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    ran = {d for be in list(_REGISTRY.values()) for ds in be.dtypes.values() for d in ds}
    if dtype not in ran:
        valid = ", ".join(sorted(str(d).replace("torch.", "") for d in ran))
        raise BlockDiagError(f"{fn_name}: {what}={dtype!r} is not one any backend runs (they run {valid})")


def registry() -> Mapping[str, Backend]:
    """A read-only view of the registry."""
    import types

    return types.MappingProxyType(_REGISTRY)


def double_grad_backends(device: Optional[str] = None) -> list[str]:
    """The registered backends whose backward is itself differentiable (``double_grad``).

    Read from each :class:`Backend`'s declaration, so a backend registered later is
    listed too. ``device`` (a device type) keeps those that run on it.

    >>> "loop" in double_grad_backends("cpu") and "csr" not in double_grad_backends("cpu")
    True

    Whether a backward will be differentiated again (``create_graph=True``) is not known
    when the forward is planned, so :class:`Problem` carries no such flag. Two places read
    the declaration instead: the ``double_backward`` setting
    (``blockdiag.config(double_backward=True)``) keeps ``auto`` on these backends for
    training, and a backend declaring ``double_grad=False`` refuses a second backward with
    :class:`BlockDiagError` rather than return a gradient that silently treats the first
    one as a constant. (``auto`` inside a traced graph, the ``blockdiag::auto`` operator,
    needs neither: a backward that must itself be differentiable runs the generic formulas
    in differentiable torch operations whatever backend ran the forward.)

    Args:
        device: a device type such as ``"cpu"``; None lists them for every device.

    Returns:
        their names, in registration order.
    """
    return [
        b.name for b in _REGISTRY.values()
        if b.double_grad and b.grad and (device is None or device in b.dtypes)
    ]


def double_grad_hint(device: Optional[str] = None) -> str:
    """What to do for a double backward: the setting for ``auto``, or a backend that has one.

    >>> print(double_grad_hint("cpu").split(", or ")[0])
    set blockdiag.config(double_backward=True) to keep backend 'auto' on backends with a double backward

    Args:
        device: a device type; None names the backends of every device.

    Returns:
        one sentence, listing :func:`double_grad_backends` (``device``) in registration order.
    """
    ok = double_grad_backends(device)
    advice = ("set blockdiag.config(double_backward=True) to keep backend 'auto' on backends with a "
              "double backward")
    if not ok:
        return f"no registered backend{'' if device is None else ' for ' + device} has a double backward"
    return f"{advice}, or name one: {', '.join(map(repr, ok))}"
