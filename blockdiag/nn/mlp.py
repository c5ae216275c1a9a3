"""``GroupedMLP``: ``heads`` independent MLPs (the forum's loop of heads) as one module."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.autograd import forward_ad as _fwad
from torch.nn.modules import module as _nn_module
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .. import settings as _settings
from .._checks import check, check_operand_kinds
from ..backends import get
from ..dispatch import Plan
from ..ops._define import _records, rows_pay
from ..ops._sharding import refuse_sharded
from ..ops.auto import route_token, traced_routes
from ..ops.fm_rows import fm_rows
from .linear import GroupedLinear, _compile_guard, check_plain_linear

__all__ = ["GroupedMLP", "MLPPlan", "STRATEGIES"]

# The torch.nn modules that act on each entry alone, with no state: the only ones GroupedMLP
# can apply to its hidden units, which it holds as [heads, hidden, batch] (feature-major) or
# [batch, heads * hidden]. A row-wise module (Softmax, LayerNorm) would mix the heads or run
# over the batch, and a module with parameters (PReLU) would share one head's parameters
# across all heads. Modules defined outside torch.nn are accepted when they hold no
# parameters or buffers and derive from no other torch.nn module; that they act
# element-wise is the caller's promise.
ELEMENTWISE_ACTIVATIONS = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.RReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Hardshrink,
    nn.Softshrink, nn.Tanhshrink, nn.Softplus, nn.Softsign, nn.LogSigmoid, nn.Threshold,
    nn.Identity, nn.Dropout, nn.AlphaDropout,
)


def _is_torch_nn(cls: type) -> bool:
    mod = getattr(cls, "__module__", "") or ""
    return mod == "torch.nn" or mod.startswith(("torch.nn.", "torch.ao.nn."))


def _not_elementwise_base(act: object) -> Optional[type]:
    """The torch.nn class in ``type(act)``'s MRO that is not element-wise, or None.

    Every torch.nn class an activation derives from, except ``nn.Module`` itself, must be one
    of ``ELEMENTWISE_ACTIVATIONS`` or a base class of one (``Hardtanh`` for ``ReLU6``,
    ``_DropoutNd`` for ``Dropout``): a subclass of ``nn.Softmax`` defined elsewhere is
    still a softmax. The class's own module name is not enough to decide.
    """
    for cls in type(act).__mro__:
        if cls is nn.Module or not _is_torch_nn(cls):
            continue
        if not any(issubclass(e, cls) for e in ELEMENTWISE_ACTIVATIONS):
            return cls
    return None


def _check_activation(fn: str, act: object, where: str) -> None:
    check(fn, isinstance(act, nn.Module), f"{where} must be an nn.Module, got {type(act).__name__}")
    if type(act) is nn.Sequential:
        # Several element-wise modules in a row (``ReLU`` then ``Dropout``) are element-wise:
        # a head's ``Linear, ReLU, Dropout, Linear`` groups with one such Sequential.
        check(fn, len(act) > 0, f"{where} is an empty nn.Sequential")
        for k, m in enumerate(act):
            _check_activation(fn, m, f"{where}[{k}]")
        return
    state = [n for n, _ in act.named_parameters()] + [n for n, _ in act.named_buffers()]
    check(
        fn,
        not state,
        f"{where} is {act!r}, which holds parameters or buffers ({', '.join(state)}); one "
        "activation module serves every head, so only stateless element-wise activations can be grouped",
    )
    bad = _not_elementwise_base(act)
    derives = "" if bad is None or bad is type(act) else f" (it derives from torch.nn.{bad.__name__})"
    check(
        fn,
        bad is None,
        f"{where} is {act!r}, which is not element-wise{derives}; GroupedMLP applies activations to "
        f"every head's hidden units at once, so only these torch.nn modules can be used: "
        f"{', '.join(c.__name__ for c in ELEMENTWISE_ACTIVATIONS)} (or a stateless element-wise module of your own)",
    )


# How GroupedMLP runs its layers (see the class docstring): "layers" calls each layer
# (``GroupedLinear.__call__``, so hooks, parametrizations, pruning and FSDP2 see every call,
# and each layer's backend is planned by the chooser); "fm_chain" is the fused feature-major
# chain of addmm/baddbmm on the layers' parameters; "heads" runs each head's layers in turn,
# as the loop of nn.Sequential heads does, on views of the layers' parameters; "auto" takes
# the chain only where nothing observes or rewrites the layers and the measured table says
# it is faster, and the heads where TRACED_HEADS_RULE (traced) or EAGER_HEADS_RULE says.
STRATEGIES = ("auto", "layers", "fm_chain", "heads")

_PLAIN = (torch.Tensor, nn.Parameter)

# Activations (exactly these classes: a subclass may override forward) whose effect the
# chain can apply in place on its own hidden tensor where nothing differentiates the call.
_IN_PLACE: dict[type, Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]] = {
    nn.ReLU: lambda m: torch.relu_,
    nn.LeakyReLU: lambda m: lambda h: torch.nn.functional.leaky_relu_(h, m.negative_slope),
    nn.SiLU: lambda m: lambda h: torch.nn.functional.silu(h, inplace=True),
    nn.Tanh: lambda m: torch.tanh_,
    nn.Sigmoid: lambda m: torch.sigmoid_,
}


def _in_place(act: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``act`` as a function that overwrites its input where it has an in-place form, else ``act``."""
    if type(act) is nn.Sequential and not _act_hooked(act):
        # A step's input is a tensor the chain owns when it is the hidden product or what a
        # torch.nn step returned (its input, overwritten or not, or a new tensor); a module
        # of the caller's own might return a tensor it keeps, so the step after it is not
        # made in place.
        steps, owned = [], True
        for m in act:
            steps.append(_in_place(m) if owned else m)
            owned = _is_torch_nn(type(m))

        def run(h: torch.Tensor) -> torch.Tensor:
            for step in steps:
                h = step(h)
            return h

        return run
    make = _IN_PLACE.get(type(act))
    return act if make is None else make(act)


def _act_hooked(act: nn.Module) -> bool:
    """Whether ``act`` or a module inside it (a Sequential's steps) has hooks."""
    return _hooked(act) or (bool(act._modules) and any(_hooked(m) for m in act.modules()))

# One C call for "is autocast on anywhere?" (private API, hence optional).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_on() -> bool:
    if _ANY_AUTOCAST is not None:
        return _ANY_AUTOCAST()
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda") if torch.amp.is_autocast_available(d))


def _plain(t: torch.Tensor, traced: bool) -> bool:
    """A plain tensor parameter, not a subclass such as DTensor (FSDP2's parameters).

    While tracing, parameters may be the tracer's own tensors (``torch.export`` passes
    FakeTensors): those are plain, a traceable wrapper subclass (DTensor) is not.
    """
    return type(t) in _PLAIN or (traced and not is_traceable_wrapper_subclass(t))


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


@dataclass(frozen=True)
class MLPPlan:
    """What :class:`GroupedMLP` runs for an input, and why (``str(plan)`` is a report).

    Attributes:
        strategy: what runs: ``"fm_chain"``, ``"layers"`` or ``"heads"``.
        requested: the model's ``strategy`` setting (``"auto"``, ``"layers"``, ``"fm_chain"`` or ``"heads"``).
        reason: one sentence on why.
        chain_us: the measured table's estimate of the chain in microseconds: the sum over
            layers of ``bmm_fm``'s time at each layer's problem; None where not estimated.
        layers_us: the estimate of the per-layer path: the sum of each layer's chosen
            backend's time; None where not estimated.
        layers: each layer's :class:`~blockdiag.dispatch.Plan` for its input (what runs on
            the ``"layers"`` path).
    """

    strategy: str
    requested: str
    reason: str
    chain_us: Optional[float] = None
    layers_us: Optional[float] = None
    layers: tuple[Plan, ...] = ()

    def __str__(self) -> str:
        def us(t: Optional[float]) -> str:
            return "-" if t is None else f"{t:.1f} us"

        lines = [
            f"GroupedMLP plan (strategy={self.requested!r})",
            f"  runs:    {self.strategy}",
            f"  reason:  {self.reason}",
            f"  estimates from the measured table: fm_chain {us(self.chain_us)}, layers {us(self.layers_us)}",
        ]
        used = "" if self.strategy == "layers" else (
            " (not used: the chain runs instead)" if self.strategy == "fm_chain" else " (not used: the heads run instead)")
        for k, plan in enumerate(self.layers):
            lines.append(f"layers[{k}]{used}:")
            lines += ["  " + line for line in str(plan).splitlines()]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython shows the readable form
        p.text(str(self))


# What the chain saves over the same products run layer by layer (one transposing copy and
# one module call per layer, and the layout changes between layers whose backends differ)
# is in no measured table: each table time is one whole layer call. Where the strategies
# have not been timed against each other, the chain is credited this factor over the sum of
# ``bmm_fm``'s table times; ``strategy=`` forces either.
CHAIN_ADVANTAGE = 1.1

# Device types where the two strategies were timed against each other, whole models
# (scripts/bench_mlp_strategy.py; the figures are in docs/results/mlp-strategy-cpu.json and
# on the docs' Performance page): there ``auto`` runs the chain wherever it is allowed,
# except in training a model with one grouped layer (a shared input and one hidden layer),
# and the table's per-layer sums are only reported. Such a model has no layout change
# between grouped layers for the chain to save; in training the chain then only replaces
# that layer's backend by ``bmm_fm`` with torch's autograd. The layers were faster or level
# at every such point timed, whatever their backend (``simd`` on the small blocks, a
# ``bmm_fm`` variant on the 256x256 ones at small batches, where the chain's own kernel is
# the same product): where the chain came out ahead, it was by less than the runs varied.
CHAIN_WHEREVER_ALLOWED = frozenset({"cpu"})

# A graph traced at a concrete batch decides as eager ``auto`` does only where its grouped
# layers' forward products come to at least this many FLOPs; below, it keeps the device rule
# of a symbolic batch (the chain on a device type in CHAIN_WHEREVER_ALLOWED).
# In a compiled graph each layer is an opaque op (a C kernel's, or ``blockdiag::auto``) with
# a fixed cost per call, forward and backward, and its activation is not fused with the
# products, while the chain's torch ops are fused by the compiler: the layers' gain grows
# with the work and their cost does not. ``blockdiag bench --compiled`` over the whole grid
# with each rule (docs/results/mlp-traced-strategy-avx512.json, ordered by these FLOPs):
# following eager everywhere made the smallest points slower, the largest faster or level,
# and the points between went either way; the floor sits above them. A graph whose grouped
# layers all take a native route (``blockdiag.ops.auto``: the C++ ops of the backend eager
# would run, recorded instead of the op) decides as eager does at any size: those layers
# cost no Python per call (the same file has the grid under that rule too).
TRACED_LAYERS_MIN_FLOPS = 10_000_000

# A graph traced on a device type in this set runs the heads one after another (strategy
# "heads") where it is allowed and every grouped layer's block (``in * out``) comes to at
# least the first number of a pair, for at most its second number of heads (None: any): there
# each head's products are large enough that batching them gains nothing in a compiled
# graph, and the compiler takes the head-by-head products as it takes the nn.Linear loop's,
# while the chain's and the layers' span every head. The rule reads no batch, so a graph
# serving every batch size follows it too. Measured with scripts/bench_mlp_heads.py over
# bench's grid (docs/results/mlp-heads-strategy-avx512.json): compiled, the heads were
# faster than ``auto`` at the 256x256 blocks and at 64x64 with 4 heads (all but one point),
# slower at the smaller blocks and at 64x64 with 16 or 50 heads. Eager ``auto`` follows
# EAGER_HEADS_RULE instead (below): eager, the heads win at fewer shapes.
HEADS_DEVICES = frozenset({"cpu"})
TRACED_HEADS_RULE = ((256 * 256, None), (64 * 64, 4))

# Eager ``auto`` runs the heads on a device type in HEADS_DEVICES, in training, where every
# grouped layer's block comes to at least the first number of elements, the model has at
# least the second number of heads and the batch at least the third number of rows. The
# same timings (two runs): eager, the heads beat ``auto`` only at 256x256 blocks with 16 or
# 50 heads and 256 rows or more, the points where ``auto`` was slower than the nn.Linear
# loop; with 4 heads, or 32 rows, or smaller blocks they were slower.
EAGER_HEADS_RULE = (256 * 256, 16, 256)


class GroupedMLP(nn.Module):
    """``heads`` independent MLPs ``in -> hidden... -> out``, computed together.

    Equals ``torch.cat([head(x) for head in heads], -1)`` for ``heads`` separate
    ``nn.Sequential(Linear, act, ..., Linear)`` (see :meth:`from_heads`), but every layer is
    one grouped multiply instead of ``heads`` small ones.

    With ``shared_input=True`` every head reads all of ``x``: the first layer is one wide
    ``in_features -> heads * hidden`` matmul (``groups=1``), with no copy or expansion of
    ``x`` (splitting a shared input into groups is the forum's bug). With
    ``shared_input=False``, ``x`` has ``heads * in_features`` columns and head ``h`` reads
    slice ``h``. The output is ``[..., heads * out_features]``, head ``h``'s outputs contiguous.

    How the layers run is ``strategy``; what multiplies inside each layer is ``backend``
    (every layer's :class:`GroupedLinear` backend, ``"auto"`` by default):

    - ``"layers"``: each layer is called as a module (``layer(h)``, its ``__call__``), so
      forward and backward hooks on ``model.layers[k]`` fire, ``torch.nn.utils.prune``,
      parametrizations, old-style ``weight_norm`` and per-layer FSDP2 ``fully_shard`` work,
      and each layer's backend is planned by the chooser (:meth:`GroupedLinear.plan`).
    - ``"fm_chain"``: the fused feature-major chain. The hidden units stay
      ``[heads, hidden, batch]`` between layers: the first layer is one ``addmm`` (shared
      input) or ``baddbmm``, each later one a ``baddbmm`` with the bias fused, and only the
      final output is transposed once into ``[batch, heads * out]``. It reads the layers'
      parameters directly and never calls the layers, so it refuses (``BlockDiagError``) a
      model whose layers have hooks or parametrizations (pruning, ``weight_norm``), whose
      activations have hooks (they would see the feature-major layout), whose parameters
      are not plain tensors (DTensor, FSDP2) or whose dtype or device differ from ``x``'s.
    - ``"heads"``: head by head, as ``torch.cat([head(x) for head in heads], -1)`` runs:
      each head's layers are ``F.linear`` calls on its views of the layers' parameters (one
      ``unbind`` per parameter, so the backward stacks each parameter's gradient once), and
      the heads' outputs are concatenated. A head's hidden units stay small while its layers
      run, where the chain's and the layers' span every head; with few heads and large
      blocks that is what the loop of ``nn.Linear`` gains, and this strategy gains it too.
      It reads the parameters directly, so it refuses what ``"fm_chain"`` refuses. ``auto``
      runs it where it is allowed and the shapes call for it: a traced ``auto``
      (``torch.compile``, ``torch.export``) where ``TRACED_HEADS_RULE`` says, eager ``auto``
      in training where ``EAGER_HEADS_RULE`` says (large blocks, many heads, large batches).
    - ``"auto"`` (default): the heads where they are allowed and ``EAGER_HEADS_RULE`` (or,
      traced, ``TRACED_HEADS_RULE``) says, else the chain where it is allowed and measured
      faster, else ``"layers"``. Allowed: every layer's backend is ``"auto"`` (a backend you name is
      honoured), nothing above would refuse the chain, no global module hook is registered,
      no ``torch.func`` transform or autocast is active and the batch is not empty. A
      ``torch.compile`` or ``torch.export`` trace with a symbolic batch (one graph for every
      batch size) does not read the table: on a device type in ``CHAIN_WHEREVER_ALLOWED``
      the chain runs wherever it is allowed, elsewhere the layers run, each planned as
      ``auto`` plans in a traced graph. A trace at a concrete batch decides as eager does
      where the grouped layers' products come to ``TRACED_LAYERS_MIN_FLOPS`` or more, or
      where ``torch.compile`` records every grouped layer's C++ ops (a native route, see
      there), and by that device rule elsewhere. Before either, any trace on a device type in
      ``HEADS_DEVICES`` runs the heads where they are allowed and every grouped
      block is as large as ``TRACED_HEADS_RULE`` asks. Faster: the measured table (the one
      :func:`blockdiag.choose` uses) estimates the chain as the sum over layers of
      ``bmm_fm``'s time at each layer's problem, and the layers as the sum of each layer's
      chosen backend's time. On a device type in ``CHAIN_WHEREVER_ALLOWED`` (the CPU), where
      the whole models were timed (``scripts/bench_mlp_strategy.py``), the chain runs
      wherever the table has both sums, except in training a model with one grouped layer
      (see ``CHAIN_WHEREVER_ALLOWED``);
      elsewhere it runs when its estimate is at most ``CHAIN_ADVANTAGE`` times the layers':
      what the chain saves (a transposing copy and a layer call per layer, and the layout
      changes between layers) is in no table, and that factor credits it. Without a table
      entry for either, the layers run. The decision is cached per input shape, dtype,
      device, grad mode and the chooser's epoch (settings,
      profile, registry, thread count: see :mod:`blockdiag.dispatch`), like
      ``GroupedLinear``'s; whether the chain is allowed is checked on every call (a few
      dict reads: a hook can be added at any time).

    :meth:`plan` says which strategy runs for an input and why, with each layer's plan.

    >>> mlp = GroupedMLP(150, [10, 10], 1, heads=50)
    >>> mlp(torch.randn(32, 150)).shape
    torch.Size([32, 50])

    Args:
        in_features: input features of one head.
        hidden_features: hidden width per head: an int (one hidden layer) or a sequence (one
            entry per hidden layer; may be empty for a single grouped linear).
        out_features: output features of one head.
        heads: number of independent heads.
        activation: a factory (class or callable) of the activation module after each
            hidden layer: stateless and element-wise (``ELEMENTWISE_ACTIVATIONS`` lists the
            torch.nn ones accepted), or an ``nn.Sequential`` of such modules
            (``lambda: nn.Sequential(nn.ReLU(), nn.Dropout(0.1))``).
        output_activation: None (the default: the heads end with their last Linear), or a
            factory of the same kind for a module applied to every head's output (an RL
            actor's ``nn.Tanh``). It runs on ``[..., heads * out]``, so it must be
            element-wise as well.
        bias: learn biases: one bool for every layer, or one per layer (``[True, False]``
            for a last layer without bias).
        shared_input: see above.
        backend: ``"auto"`` or a registered backend name for every layer (settable later).
        strategy: ``"auto"``, ``"layers"`` or ``"fm_chain"`` (settable later), see above.
        device: factory kwarg, as for ``nn.Linear``.
        dtype: factory kwarg, as for ``nn.Linear``.

    Raises:
        BlockDiagError: non-positive sizes, an unknown backend or strategy, or an activation
            that is not stateless and element-wise.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int | Sequence[int],
        out_features: int,
        heads: int,
        *,
        activation: Callable[[], nn.Module] = nn.ReLU,
        output_activation: Optional[Callable[[], nn.Module]] = None,
        bias: bool | Sequence[bool] = True,
        shared_input: bool = True,
        backend: str = "auto",
        strategy: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        fn = type(self).__name__
        hidden = [hidden_features] if isinstance(hidden_features, int) else list(hidden_features)
        sizes = [in_features, *hidden, out_features]
        check(
            fn,
            all(isinstance(s, int) and s >= 1 for s in sizes),
            f"in_features, hidden_features and out_features must be positive ints, got {sizes}",
        )
        check(fn, isinstance(heads, int) and heads >= 1, f"heads must be a positive int, got {heads!r}")
        self.in_features, self.hidden_features, self.out_features = in_features, tuple(hidden), out_features
        self.heads = heads
        self.shared_input = shared_input
        factory = {"device": device, "dtype": dtype}
        # As for nn.Linear, any truthy value means a bias; a list or tuple gives one per layer.
        biases = [bool(b) for b in bias] if isinstance(bias, (list, tuple)) else [bool(bias)] * (len(sizes) - 1)
        check(
            fn,
            len(biases) == len(sizes) - 1,
            f"bias must be a bool or one bool per layer ({len(sizes) - 1} layers), got {bias!r}",
        )
        layers = []
        for k in range(len(sizes) - 1):
            if k == 0 and shared_input:
                layers.append(GroupedLinear(sizes[0], heads * sizes[1], 1, biases[k], backend=backend, **factory))
            else:
                layers.append(
                    GroupedLinear(heads * sizes[k], heads * sizes[k + 1], heads, biases[k], backend=backend, **factory)
                )
        self.layers = nn.ModuleList(layers)
        for arg, make in (("activation", activation), ("output_activation", output_activation)):
            check(
                fn,
                not isinstance(make, nn.Module),
                f"{arg} must be a factory that makes a module (a class such as nn.Tanh, or a lambda), "
                f"not a module instance ({make!r}): the model makes its own",
            )
        acts = [activation() for _ in hidden]
        for k, act in enumerate(acts):
            _check_activation(fn, act, f"activation() after hidden layer {k}")
        self.activations = nn.ModuleList(acts)
        out_act = None
        if output_activation is not None:
            out_act = output_activation()
            _check_activation(fn, out_act, "output_activation()")
        self.output_activation = out_act
        self.backend = backend
        self.strategy = strategy
        self._decisions: dict = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_decisions"] = {}  # a cache: rebuilt where the model is loaded
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # Pickles from before ``strategy`` existed ran the chain under "auto"/"bmm".
        self.__dict__.setdefault("_strategy", "auto")
        self.__dict__.setdefault("_decisions", {})

    @property
    def backend(self) -> str:
        """``"auto"`` or a backend name; setting it sets every layer's backend too."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if name != "auto":
            get(name, f"{type(self).__name__}.backend")
        self._backend = name
        for layer in self.layers:
            layer.backend = name

    @property
    def strategy(self) -> str:
        """``"auto"``, ``"layers"``, ``"fm_chain"`` or ``"heads"``: how the layers run (see the class docstring)."""
        return self._strategy

    @strategy.setter
    def strategy(self, name: str) -> None:
        check(
            f"{type(self).__name__}.strategy",
            isinstance(name, str) and name in STRATEGIES,
            f"unknown strategy {name!r}; valid strategies are {', '.join(map(repr, STRATEGIES))}",
        )
        self._strategy = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., heads * out]`` (``[..., heads * in]`` without ``shared_input``).

        Raises:
            BlockDiagError: an input whose last dimension, dtype or device does not fit, or
                ``strategy="fm_chain"`` or ``"heads"`` on a model it cannot run (see the class docstring).
        """
        try:
            y = self._forward(x)
        except Exception:
            # The clear error for a sparse, nested or non-tensor input, which fails inside
            # first (no per-call check: a try costs nothing until it raises).
            check_operand_kinds(type(self).__name__, input=x)
            raise
        out = self._modules.get("output_activation")
        return y if out is None else out(y)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        n_in = self.in_features if self.shared_input else self.in_features * self.heads
        if x.dim() < 1 or x.shape[-1] != n_in:  # the message only when it is needed: this runs per call
            check(
                type(self).__name__,
                False,
                f"input has shape {tuple(x.shape)}; its last dimension must be {n_in}"
                + ("" if self.shared_input else f" (heads={self.heads} x in_features={self.in_features})"),
            )
        strategy = self._strategy
        if strategy == "auto":
            if torch.compiler.is_compiling():  # first: dynamo folds it to a constant
                traced = self._traced_strategy(x)
                if traced == "fm_chain":
                    return self._forward_feature_major(x)
                if traced == "heads":
                    return self._forward_heads(x)
            else:
                chosen = self._auto_strategy(x)
                if chosen == "fm_chain":
                    return self._forward_feature_major(x)
                if chosen == "heads":
                    return self._forward_heads(x)
        elif strategy != "layers":
            why = self._chain_refusal(x, traced=torch.compiler.is_compiling(), strategy=strategy)
            check(type(self).__name__, why is None, f"strategy={strategy!r} cannot run: {why}; use strategy='layers' or 'auto'")
            return self._forward_feature_major(x) if strategy == "fm_chain" else self._forward_heads(x)
        acts = tuple(self._modules["activations"]._modules.values())
        n_act = len(acts)
        for k, layer in enumerate(self._modules["layers"]._modules.values()):
            x = layer(x)
            if k < n_act:
                x = acts[k](x)
        return x

    # ------------------------------------------------------------ choosing the strategy

    def _chain_refusal(self, x: torch.Tensor, traced: bool = False, strategy: str = "fm_chain") -> Optional[str]:
        """Why ``strategy`` (``"fm_chain"`` or ``"heads"``, which both read the parameters and
        call no layer) would skip or break something here (None: it runs as the layers would).

        Checked on every call: hooks and parametrizations can be added at any time.
        """
        if strategy == "heads":
            return self._params_refusal(x, traced, "the heads strategy",
                                        "one head's [batch, hidden] at a time instead of every head's")
        return self._params_refusal(x, traced, "the chain", "the chain's feature-major [heads, hidden, batch] layout")

    def _params_refusal(self, x: torch.Tensor, traced: bool, who: str, activation_sees: str) -> Optional[str]:
        mm = _nn_module
        if mm._global_forward_hooks or mm._global_forward_pre_hooks or mm._global_backward_hooks or mm._global_backward_pre_hooks:
            return f"a global module hook is registered (torch.nn.modules.module.register_module_*_hook), and {who} calls no layer"
        # Dtypes are compared for every parameter, the device for the first weight only: a
        # parameter elsewhere on another device fails on either path, and each comparison
        # of devices costs a device object.
        dt = x.dtype
        for k, layer in enumerate(self._modules["layers"]._modules.values()):
            if _hooked(layer):
                return (
                    f"layers[{k}] has forward or backward hooks (torch.nn.utils.prune and the old "
                    f"weight_norm use them too), and {who} never calls the layer"
                )
            params = layer._parameters
            if "parametrizations" in layer._modules:
                return f"layers[{k}] is parametrized (torch.nn.utils.parametrize), and {who} reads the raw parameters"
            w = params.get("weight")
            if w is None or not _plain(w, traced):
                return f"layers[{k}].weight is not a plain tensor parameter (a DTensor, another subclass, or rewritten)"
            if w.dtype != dt or (k == 0 and w.device != x.device):
                return f"layers[{k}].weight is {w.dtype} on {w.device} but the input is {dt} on {x.device}"
            if "bias" not in params:
                return f"layers[{k}].bias is not a registered parameter (rewritten)"
            b = params["bias"]
            if b is not None and (not _plain(b, traced) or b.dtype != dt):
                return f"layers[{k}].bias is not a plain tensor parameter of the input's dtype"
        for k, act in enumerate(self._modules["activations"]._modules.values()):
            if _act_hooked(act):
                return f"activations[{k}] has hooks, which would see {activation_sees}"
        return None

    def _auto_context(self, x: torch.Tensor) -> Optional[str]:
        """Why ``auto`` runs the layers whatever the table says, or None (the cheap checks first)."""
        if torch.compiler.is_compiling() and x.device.type not in CHAIN_WHEREVER_ALLOWED:
            return ("torch.compile or export is tracing, and on this device the table decides per batch: each "
                    "layer plans as auto does in a traced graph, so one graph serves every batch size")
        if x.numel() == 0:
            return "the batch is empty"
        if x.is_meta or type(x) not in _PLAIN:
            return "the input is a meta, fake or subclass tensor: each layer runs it as its operator does"
        if torch._C._get_tracing_state() is not None:
            return "torch.jit.trace is recording: each layer records as GroupedLinear does under it"
        if torch._C._are_functorch_transforms_active():
            return "a torch.func transform is active"
        if _autocast_on():
            return "autocast is on: each layer casts and plans in autocast's dtype"
        for k, layer in enumerate(self._modules["layers"]._modules.values()):
            if layer._backend != "auto":
                return f"layers[{k}] has backend={layer._backend!r}, which is honoured"
        return self._chain_refusal(x)

    def _auto_strategy(self, x: torch.Tensor) -> str:
        """Eager ``auto``'s per-call strategy: the checks of :meth:`_auto_context`, then the cached choice.

        The same checks as ``_auto_context`` (which says why, for :meth:`plan`), in one pass
        and without building messages: this runs on every call. (A traced call decides by
        :meth:`_traced_strategy` instead.)
        """
        if (
            x.numel() == 0
            or torch._C._get_tracing_state() is not None
            or x.is_meta
            or type(x) not in _PLAIN
            or torch._C._are_functorch_transforms_active()
            or (_ANY_AUTOCAST() if _ANY_AUTOCAST is not None else _autocast_on())
        ):
            return "layers"
        mm = _nn_module
        if mm._global_forward_hooks or mm._global_forward_pre_hooks or mm._global_backward_hooks or mm._global_backward_pre_hooks:
            return "layers"
        dt = x.dtype
        grad = torch.is_grad_enabled()
        rg = grad and x.requires_grad
        mask, bit = 0, 1  # bit k: autograd records layer k's product
        dev = None
        for layer in self._modules["layers"]._modules.values():
            if (
                layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks or layer._backward_pre_hooks
                or layer._backend != "auto" or "parametrizations" in layer._modules
            ):
                return "layers"
            p = layer._parameters
            w = p.get("weight")
            if w is None or type(w) not in _PLAIN or w.dtype != dt or "bias" not in p:
                return "layers"
            if dev is None:
                dev = w.device
                if dev != x.device:
                    return "layers"
            b = p["bias"]
            if b is not None and (type(b) not in _PLAIN or b.dtype != dt):
                return "layers"
            if grad and not rg:
                rg = w.requires_grad or (b is not None and b.requires_grad)
            if rg:
                mask |= bit
            bit <<= 1
        for act in self._modules["activations"]._modules.values():
            if _act_hooked(act):
                return "layers"
        # The epoch (blockdiag.dispatch's: settings, profile, registry, thread count) moves
        # whenever the table's answer may change, so an entry is never checked, only looked up.
        ep = _settings.epoch()
        key = (x.shape, dt, dev, mask, ep)
        chosen = self._decisions.get(key)
        if chosen is not None:
            return chosen
        if mask and self._eager_heads_pay(x):
            chosen = "heads"
        else:
            chosen = "fm_chain" if self._measured_choice(x)[0] else "layers"
        if ep == _settings.epoch():  # kept only if the epoch did not move while planning
            if len(self._decisions) > 256:
                self._decisions.clear()
            self._decisions[key] = chosen
        return chosen

    def _smallest_grouped_block(self) -> Optional[int]:
        """The fewest elements (``in * out``) of a grouped layer's block; None without a grouped layer."""
        sizes = [(layer.in_features // layer.groups) * (layer.out_features // layer.groups)
                 for layer in self._modules["layers"]._modules.values() if layer.groups > 1]
        return min(sizes) if sizes else None

    def _eager_heads_pay(self, x: torch.Tensor) -> bool:
        """``EAGER_HEADS_RULE`` (shapes only; the caller checked the heads are allowed and in training)."""
        area, heads, rows = EAGER_HEADS_RULE
        smallest = self._smallest_grouped_block()
        return (x.device.type in HEADS_DEVICES and smallest is not None and smallest >= area
                and self.heads >= heads and x.shape[:-1].numel() >= rows)

    def _traced_strategy(self, x: torch.Tensor) -> str:
        """``auto``'s strategy while dynamo traces: the heads where ``TRACED_HEADS_RULE`` says,
        else the chain where :meth:`_traced_runs_chain` says, else the layers."""
        if self._traced_runs_heads(x):
            return "heads"
        return "fm_chain" if self._traced_runs_chain(x) else "layers"

    def _traced_runs_heads(self, x: torch.Tensor) -> bool:
        """Whether a traced ``auto`` runs the heads (``TRACED_HEADS_RULE``; shapes only, no batch)."""
        if x.device.type not in HEADS_DEVICES:
            return False
        layers = tuple(self._modules["layers"]._modules.values())
        smallest = self._smallest_grouped_block()
        if smallest is None or x.numel() == 0 or torch._C._are_functorch_transforms_active() or _autocast_on():
            return False
        if not any(smallest >= area and (most is None or self.heads <= most) for area, most in TRACED_HEADS_RULE):
            return False
        if any(layer._backend != "auto" for layer in layers):
            return False
        return self._chain_refusal(x, traced=True, strategy="heads") is None

    def _traced_runs_chain(self, x: torch.Tensor) -> bool:
        """``auto``'s decision while dynamo traces: eager's at a concrete batch, else the device rule.

        A graph traced at a concrete batch (the first one ``torch.compile`` makes, or every one
        with ``dynamic=False``) decides as eager ``auto`` does at that batch, from the table
        (:meth:`_measured_choice`, called outside the trace and recorded as a constant), where
        its grouped products come to ``TRACED_LAYERS_MIN_FLOPS`` or more, or where every grouped
        layer takes a native route; elsewhere it keeps the device rule (each layer's op costs a
        compiled graph more than the fused chain there).
        The graph is guarded on :data:`blockdiag.settings.generation`, so a settings, profile or
        registry change recompiles it. A graph serving every batch size (a symbolic batch)
        cannot read the table, whose answer depends on the batch: on a device type in
        ``CHAIN_WHEREVER_ALLOWED`` it runs the chain wherever it is allowed, elsewhere the
        layers, each planned as ``auto`` plans in a traced graph. Dynamo guards on what these
        checks read (hooks, parameters, backends), so adding a hook recompiles.
        """
        if x.numel() == 0 or torch._C._are_functorch_transforms_active() or _autocast_on():
            return False
        for layer in self._modules["layers"]._modules.values():
            if layer._backend != "auto":
                return False
        if self._chain_refusal(x, traced=True) is not None:
            return False
        rows = 1
        for size in x.shape[:-1]:  # not Size.numel(), which makes a symbolic batch a number
            rows = rows * size
        if not _concrete(rows):  # a symbolic batch: the graph serves every batch size
            return x.device.type in CHAIN_WHEREVER_ALLOWED
        _compile_guard(_settings.generation)
        return _traced_measured_choice(self, rows, torch.is_grad_enabled(), x.requires_grad)

    def _layer_plans(self, x: torch.Tensor) -> tuple[Plan, ...]:
        """Each layer's plan for the input it would get (``GroupedLinear.plan`` on stand-ins)."""
        lead = x.shape[:-1].numel()
        grad_enabled = torch.is_grad_enabled()
        rg = x.requires_grad
        plans = []
        for layer in self.layers:
            # A stand-in of the layer's input: right shape, dtype, device and requires_grad,
            # one element of storage (the plan reads no data).
            stand_in = torch.empty((), dtype=x.dtype, device=x.device)
            if rg and grad_enabled and stand_in.is_floating_point():
                stand_in.requires_grad_()
            plans.append(layer.plan(stand_in.expand(lead, layer.in_features)))
            rg = rg or any(p.requires_grad for p in layer.parameters())
        return tuple(plans)

    def _measured_choice(self, x: torch.Tensor) -> tuple[bool, str, Optional[float], Optional[float], tuple[Plan, ...]]:
        """(run the chain, why, chain estimate, layers estimate, layer plans) from the measured table."""
        plans = self._layer_plans(x)
        chain_us: Optional[float] = 0.0
        layers_us: Optional[float] = 0.0
        for plan in plans:
            if plan.problem.groups == 1:
                # The shared first layer: one plain GEMM whichever strategy runs it, so it is
                # left out of both sums rather than let the table's extrapolation (from
                # grouped shapes) decide between two runs of the same product.
                continue
            by_name = {c.name: c for c in plan.candidates}
            fm, own = by_name.get("bmm_fm"), by_name.get(plan.backend)
            chain_us = None if chain_us is None or fm is None or not fm.ok or fm.estimate_us is None else chain_us + fm.estimate_us
            layers_us = None if layers_us is None or own is None or own.estimate_us is None else layers_us + own.estimate_us
        if chain_us is None or layers_us is None:
            missing = "fm_chain" if chain_us is None else "layers"
            return False, f"the measured table has no estimate for {missing} at these shapes, so the layers run", chain_us, layers_us, plans
        if x.device.type in CHAIN_WHEREVER_ALLOWED:
            grouped = [plan for plan in plans if plan.problem.groups > 1]
            if len(grouped) == 1 and grouped[0].problem.requires_grad:
                return False, ("one grouped layer, in training: with no layout change between grouped layers to "
                               f"save, the chain would only replace its backend ({grouped[0].backend}) by bmm_fm, "
                               "and the layers were faster or level in scripts/bench_mlp_strategy.py's whole-model timings"), \
                    chain_us, layers_us, plans
            return True, (f"allowed, and on {x.device.type} the chain was faster than the layers, or level, in "
                          "scripts/bench_mlp_strategy.py's whole-model timings (the table's per-layer sums "
                          "below miss the layout changes between layers)"), chain_us, layers_us, plans
        if chain_us <= CHAIN_ADVANTAGE * layers_us:
            ratio = chain_us / layers_us if layers_us > 0 else 0.0
            return True, (f"allowed, and estimated faster: the table's bmm_fm times sum to {ratio:.2f}x the layers' "
                          f"(the chain is taken up to {CHAIN_ADVANTAGE}x: it saves a copy and a call per layer)"), chain_us, layers_us, plans
        return False, f"the layers' own backends are measured {chain_us / layers_us:.2f}x faster than fm_chain", chain_us, layers_us, plans

    def plan(self, x: torch.Tensor) -> MLPPlan:
        """Which strategy runs for ``x``, why, and each layer's plan (print it for a report).

        >>> print(GroupedMLP(8, 4, 1, heads=3).plan(torch.randn(5, 8)).strategy in ("fm_chain", "layers"))
        True

        Args:
            x: an input the model would be called on (its shape, dtype, device and whether
                autograd records decide the plan; it is not computed with).

        Returns:
            an :class:`MLPPlan`.

        Raises:
            BlockDiagError: an input the model cannot run, or ``strategy="fm_chain"`` or
                ``"heads"`` where it cannot run.
        """
        fn = f"{type(self).__name__}.plan"
        n_in = self.in_features * (1 if self.shared_input else self.heads)
        check(fn, x.dim() >= 1 and x.shape[-1] == n_in, f"input has shape {tuple(x.shape)}; its last dimension must be {n_in}")
        plans = self._layer_plans(x)
        if self._strategy == "layers":
            return MLPPlan("layers", "layers", "fixed by the user (strategy='layers')", layers=plans)
        if self._strategy in ("fm_chain", "heads"):
            s_ = self._strategy
            why = self._chain_refusal(x, strategy=s_)
            check(fn, why is None, f"strategy={s_!r} cannot run: {why}; use strategy='layers' or 'auto'")
            return MLPPlan(s_, s_, f"fixed by the user (strategy={s_!r})", layers=plans)
        why = self._auto_context(x)
        if why is not None:
            return MLPPlan("layers", "auto", f"the chain is not allowed here: {why}", layers=plans)
        if any(p.problem.requires_grad for p in plans) and self._eager_heads_pay(x):
            area, heads, rows = EAGER_HEADS_RULE
            return MLPPlan("heads", "auto", (
                f"allowed, in training, and every grouped block has at least {area} elements, with {heads} heads "
                f"or more and {rows} rows or more (EAGER_HEADS_RULE): there the heads one after another were "
                "faster than the chain and the layers in scripts/bench_mlp_heads.py's timings"), layers=plans)
        chain, reason, chain_us, layers_us, plans = self._measured_choice(x)
        return MLPPlan("fm_chain" if chain else "layers", "auto", reason, chain_us, layers_us, plans)

    # ------------------------------------------------------------ the fused chain

    def _forward_feature_major(self, x: torch.Tensor) -> torch.Tensor:
        # The parameters are read from ``_parameters`` (where the chain's checks found them
        # plain), and the layers and activations from their containers' dicts: attribute
        # access through nn.Module.__getattr__ and slicing a ModuleList (a new module per
        # call) cost more than the small products here.
        layers = tuple(self._modules["layers"]._modules.values())
        acts = tuple(self._modules["activations"]._modules.values())
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        n, hds = x2.shape[0], self.heads
        first = layers[0]
        if self.shared_input:
            # One wide GEMM [H*h, in] @ [in, N]: x is read in place through its transpose.
            p = first._parameters
            w, b = p["weight"][0], p["bias"]
            h = torch.addmm(b[:, None], w, x2.t()) if b is not None else w @ x2.t()
            h = h.view(hds, first.out_features // hds, n)  # not -1: an empty batch has 0 elements
        else:
            xv = x2.view(n, hds, self.in_features).permute(1, 2, 0)  # [H, in, N] view
            h = self._bmm(first, xv)
        last = len(layers) - 1
        # Not while jit.trace records: its check run repeats the call under no_grad, where the
        # in-place forms would record a different graph than the traced one.
        if last >= 1 and not self._records(x, layers) and torch._C._get_tracing_state() is None:
            # Nothing differentiates this call: each hidden product is the chain's own new
            # tensor, so an activation with an in-place form overwrites it rather than
            # allocating and writing another (scripts/bench_mlp_strategy.py's inference rows).
            acts = tuple(_in_place(a) for a in acts)
        for k in range(1, last):
            h = acts[k - 1](h)
            h = self._bmm(layers[k], h)
        if last >= 1:
            h = acts[last - 1](h)
            if torch.compiler.is_compiling() and self._traced_rows(layers[last], h):
                # A traced training graph: the last product writes rows (see ops/fm_rows.py).
                p = layers[last]._parameters
                return fm_rows(h, p["weight"], p["bias"]).view(*lead, hds * self.out_features)
            h = self._bmm(layers[last], h)
        # [H, out, N] -> [N, H*out]: the one transpose of the whole stack, a view.
        return h.permute(2, 0, 1).reshape(*lead, hds * self.out_features)

    def _forward_heads(self, x: torch.Tensor) -> torch.Tensor:
        # Each parameter is unbound into its heads once (one node, whose backward stacks the
        # heads' gradients), not sliced per head: a slice's backward writes a zero-filled
        # gradient of the whole parameter for every head.
        layers = tuple(self._modules["layers"]._modules.values())
        acts = tuple(self._modules["activations"]._modules.values())
        hds = self.heads
        if len(layers) > 1 and not self._records(x, layers) and torch._C._get_tracing_state() is None:
            acts = tuple(_in_place(a) for a in acts)  # each head's hidden tensor is its own
        weights, biases = [], []
        for layer in layers:
            p = layer._parameters
            w, b = p["weight"], p["bias"]
            # [groups, out, in]; the shared first layer's one group holds every head's rows.
            weights.append(w.view(hds, w.shape[0] * w.shape[1] // hds, w.shape[2]).unbind(0))
            biases.append((None,) * hds if b is None else b.view(hds, b.shape[0] // hds).unbind(0))
        xs = (x,) * hds if self.shared_input else x.split(self.in_features, -1)
        n_act = len(acts)
        outs = []
        for g in range(hds):
            h = xs[g]
            for k in range(len(layers)):
                h = torch.nn.functional.linear(h, weights[k][g], biases[k][g])
                if k < n_act:
                    h = acts[k](h)
            outs.append(h)
        return torch.cat(outs, -1)

    @staticmethod
    def _records(x: torch.Tensor, layers: Sequence[GroupedLinear]) -> bool:
        """Whether autograd (reverse or forward mode), or a tracer, may see this call's products."""
        if torch.compiler.is_compiling() or _fwad._current_level >= 0 or torch._C._are_functorch_transforms_active():
            return True
        if not torch.is_grad_enabled():
            return False
        if x.requires_grad:
            return True
        for layer in layers:
            for t in layer._parameters.values():
                if t is not None and t.requires_grad:
                    return True
        return False

    @staticmethod
    def _traced_rows(layer: GroupedLinear, h: torch.Tensor) -> bool:
        """Whether a traced chain's last product is ``blockdiag::fm_rows`` (a row-major result).

        Only where autograd records it (the gradient's layout is what the op saves) and where
        a block's row is long enough for the strided write to pay (``ROWS_MIN_RUN_BYTES``,
        as for the ``auto`` op); the batch is not read, so a graph serving every batch size
        is not guarded on it.
        """
        p = layer._parameters
        return _records(h, p["weight"], p["bias"]) and rows_pay(layer.block_out, h.dtype)

    @staticmethod
    def _bmm(layer: GroupedLinear, h: torch.Tensor) -> torch.Tensor:
        p = layer._parameters
        w, b = p["weight"], p["bias"]
        if b is None:
            return torch.bmm(w, h)
        return torch.baddbmm(b.view(layer.groups, layer.block_out, 1), w, h)

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, in_features={self.in_features}, hidden={list(self.hidden_features)}, "
            f"out_features={self.out_features}, shared_input={self.shared_input}, backend={self.backend!r}, "
            f"strategy={self.strategy!r}"
        )

    @classmethod
    def from_heads(
        cls, heads: Sequence[nn.Module], *, shared_input: bool = True, backend: str = "auto", strategy: str = "auto"
    ) -> "GroupedMLP":
        """Build from identical ``nn.Sequential(Linear, act, ..., Linear)`` heads, copying weights.

        Afterwards ``model(x)`` equals ``torch.cat([h(x) for h in heads], -1)`` (with
        ``shared_input=False``: head ``h`` applied to slice ``h`` of ``x``).

        >>> heads = nn.ModuleList(
        ...     nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1)) for _ in range(3))
        >>> x = torch.randn(5, 8)
        >>> torch.allclose(GroupedMLP.from_heads(heads)(x), torch.cat([h(x) for h in heads], -1), atol=1e-6)
        True

        Args:
            heads: a non-empty sequence (or ``nn.ModuleList``) of ``nn.Sequential`` modules
                of identical structure: ``Linear``, then any number of (activation, ``Linear``)
                pairs, then optionally an activation (``output_activation``), where an
                activation is one or more stateless element-wise modules (``ReLU``, or
                ``ReLU`` then ``Dropout``: several become one ``nn.Sequential``); all Linear
                shapes, bias flags, devices and dtypes equal across heads, and the same
                modules (type and settings) at each position.
            shared_input: whether every head reads all of ``x``.
            backend: for the new model.
            strategy: for the new model (``"auto"``, ``"layers"``, ``"fm_chain"`` or ``"heads"``).

        Returns:
            a ``GroupedMLP`` on the heads' device and dtype, activations deep-copied from
                ``heads[0]``.

        Raises:
            BlockDiagError: empty input, heads that differ in structure or shape (the
                message names the head and the position), or an activation with parameters
                or one that is not element-wise (PReLU, LayerNorm, Softmax, or a subclass
                of one of them).
        """
        fn = "GroupedMLP.from_heads"
        heads = list(heads)
        check(fn, len(heads) > 0, "heads is empty")
        ref = list(heads[0]) if isinstance(heads[0], nn.Sequential) else None
        check(fn, ref is not None, f"heads[0] must be an nn.Sequential, got {type(heads[0]).__name__}")
        at = [k for k, m in enumerate(ref) if isinstance(m, nn.Linear)]
        check(
            fn,
            bool(at) and at[0] == 0 and all(b - a > 1 for a, b in zip(at, at[1:])),
            "heads[0] must be Sequential(Linear, act, Linear, ..., act, Linear[, act]), where each "
            "act is one or more element-wise modules (ReLU, or ReLU then Dropout), got "
            + "(" + ", ".join(type(m).__name__ for m in ref) + ")",
        )
        for h, head in enumerate(heads):
            mods = list(head) if isinstance(head, nn.Sequential) else None
            check(fn, mods is not None, f"heads[{h}] must be an nn.Sequential, got {type(head).__name__}")
            check(
                fn,
                len(mods) == len(ref),
                f"heads[{h}] has {len(mods)} modules but heads[0] has {len(ref)}",
            )
            for k, (m, r) in enumerate(zip(mods, ref)):
                check(
                    fn,
                    type(m) is type(r),
                    f"heads[{h}][{k}] is {type(m).__name__} but heads[0][{k}] is {type(r).__name__}",
                )
                if isinstance(r, nn.Linear):
                    check_plain_linear(fn, m, f"heads[{h}][{k}]")
                    check(
                        fn,
                        m.weight.shape == r.weight.shape and (m.bias is None) == (r.bias is None),
                        f"heads[{h}][{k}] is Linear with weight {tuple(m.weight.shape)} "
                        f"bias={m.bias is not None}, but heads[0][{k}] has weight "
                        f"{tuple(r.weight.shape)} bias={r.bias is not None}",
                    )
                    check(
                        fn,
                        m.weight.device == r.weight.device and m.weight.dtype == r.weight.dtype,
                        f"heads[{h}][{k}] is on {m.weight.device} {m.weight.dtype} but heads[0][{k}] "
                        f"is on {r.weight.device} {r.weight.dtype}",
                    )
                else:
                    _check_activation(fn, m, f"heads[{h}][{k}]")
                    check(
                        fn,
                        repr(m) == repr(r),
                        f"heads[{h}][{k}] is {m!r} but heads[0][{k}] is {r!r}",
                    )
        refuse_sharded(fn, nn.ModuleList(heads), "heads.")  # DTensor heads: gather them first
        lins0 = [ref[k] for k in at]
        bias = [lin.bias is not None for lin in lins0]
        sizes = [lins0[0].in_features] + [lin.out_features for lin in lins0]
        w0 = lins0[0].weight
        model = cls(
            sizes[0], sizes[1:-1], sizes[-1], len(heads),
            bias=bias, shared_input=shared_input, backend=backend, strategy=strategy,
            device=w0.device, dtype=w0.dtype,
        )
        # The modules between two Linears: one is the activation itself, several one
        # nn.Sequential (to_heads writes them back one by one). A head's own nn.Sequential
        # is one of the several, so that to_heads gives it back nested, as the head had it.
        between = [[copy.deepcopy(m) for m in ref[a + 1:b]] for a, b in zip(at, at[1:] + [len(ref)])]
        last = between.pop()  # after the last Linear: the output activation, if any

        def steps(ms: list) -> nn.Module:
            return ms[0] if len(ms) == 1 and type(ms[0]) is not nn.Sequential else nn.Sequential(*ms)

        model.activations = nn.ModuleList(steps(ms) for ms in between)
        model.output_activation = steps(last) if last else None
        with torch.no_grad():
            for k, layer in enumerate(model.layers):
                lins = [list(head)[at[k]] for head in heads]
                layer.weight.copy_(torch.stack([lin.weight for lin in lins]).reshape(layer.weight.shape))
                if bias[k]:
                    layer.bias.copy_(torch.cat([lin.bias for lin in lins]))
        return model

    def to_heads(self) -> nn.ModuleList:
        """The ``heads`` independent ``nn.Sequential`` MLPs this model computes (copies).

        >>> len(GroupedMLP(8, 4, 1, heads=3).to_heads())
        3

        Returns:
            an ``nn.ModuleList`` of ``heads`` ``nn.Sequential(Linear, act, ..., Linear[, act])``
                (activations deep-copied) on this model's device and dtype.

        Raises:
            BlockDiagError: a distributed model (DTensor parameters, e.g. group parallel):
                ``blockdiag.distributed.gather_model`` it first, on every rank.
        """
        refuse_sharded("GroupedMLP.to_heads", self)
        sizes = [self.in_features, *self.hidden_features, self.out_features]
        out = nn.ModuleList()
        for h in range(self.heads):
            mods: list[nn.Module] = []
            for k, layer in enumerate(self.layers):
                o, i = sizes[k + 1], sizes[k]
                lin = nn.Linear(i, o, bias=layer.bias is not None, device=layer.weight.device, dtype=layer.weight.dtype)
                with torch.no_grad():
                    lin.weight.copy_(layer.weight.reshape(self.heads, o, i)[h])
                    if layer.bias is not None:
                        lin.bias.copy_(layer.bias[h * o:(h + 1) * o])
                mods.append(lin)
                if k < len(self.activations):
                    act = copy.deepcopy(self.activations[k])
                    # A Sequential of activations (from_heads' ReLU then Dropout) goes back
                    # into the head as its modules, as the head it came from had them.
                    mods.extend(act if type(act) is nn.Sequential else (act,))
            out_act = self._modules.get("output_activation")
            if out_act is not None:
                out_act = copy.deepcopy(out_act)
                mods.extend(out_act if type(out_act) is nn.Sequential else (out_act,))
            out.append(nn.Sequential(*mods))
        return out


def _traced_measured_choice(model: GroupedMLP, rows: int, grad: bool, input_grad: bool) -> bool:
    """:meth:`GroupedMLP._measured_choice` for ``rows`` input rows, outside dynamo's trace.

    Dynamo calls it once per traced graph and records its answer as a constant (it is marked
    as ``torch.compiler.assume_constant_result`` marks, see ``nn/linear.py``): the planning
    code (caches, the table) is Python that a graph should not contain. ``grad`` and
    ``input_grad``: the grad mode and whether the input requires grad where the call was
    traced (the plans depend on whether autograd records each layer). Below
    ``TRACED_LAYERS_MIN_FLOPS`` the answer is the device rule instead, unless every grouped
    layer would take a native route (see there).
    """
    first = model.layers[0]
    stand_in = torch.empty((), dtype=first.weight.dtype, device=first.weight.device)
    with torch.set_grad_enabled(grad):
        stand_in.requires_grad_(input_grad and stand_in.is_floating_point())
        chain, _, _, _, plans = model._measured_choice(stand_in.expand(rows, first.in_features))
    grouped = [p for p in plans if p.problem.groups > 1]
    if sum(p.problem.flops for p in grouped) >= TRACED_LAYERS_MIN_FLOPS:
        return chain
    routes = traced_routes(first.weight.dtype, first.weight.device.type).split()
    if grouped and all(route_token(p.backend, p.problem.dtype) in routes for p in grouped):
        return chain  # every grouped layer on a native route: no op cost per call (see TRACED_LAYERS_MIN_FLOPS)
    return first.weight.device.type in CHAIN_WHEREVER_ALLOWED  # the device rule, as at a symbolic batch


_traced_measured_choice._dynamo_marked_constant = True


def _concrete(n) -> bool:
    """Whether ``n`` is a number, not a symbol, in the graph dynamo is tracing.

    Dynamo answers ``isinstance(n, int)`` with True for a symbolic size too, so the test is
    whether comparisons with it are decided: for a number every one is; for a symbolic size
    (a range ``[lo, hi]`` of two values or more) ``n == v`` is not where ``lo <= v <= hi``.
    The probes are the powers of two, with ``n <= v`` too: a range strictly between two
    consecutive ones (``[17, 31]``) would pass for a number, and the planning would then
    refuse its symbol loudly.
    """
    from torch.fx.experimental.symbolic_shapes import statically_known_true  # only ever traced

    for k in range(63):
        v = 1 << k
        if not (statically_known_true(n == v) or statically_known_true(n != v)):
            return False
        if not (statically_known_true(n <= v) or statically_known_true(n > v)):
            return False
    return True
