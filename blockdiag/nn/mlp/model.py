"""``GroupedMLP``: the module, its layers and the paths that run them."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.autograd import forward_ad as _fwad

from ..._checks import as_size, check, check_operand_kinds, is_int
from ..._errors import BlockDiagError
from ...backends import get
from ...backends._registry import check_dtype
from ...ops._define import _records, rows_pay
from ...ops.fm_rows import fm_rows
from ..linear import GroupedLinear, fx_tracer, refuse_replaced_shapes
from . import heads as _heads
from . import strategy as _strategy
from .activations import Activations, _check_activation, _in_place, _random
from .strategy import STRATEGIES, MLPPlan, StrategyChoice


def _make_activation(fn: str, arg: str, make: object) -> object:
    """``make()``, where ``make`` is the factory passed as ``arg``; what it returns is checked by the caller.

    What torch.nn's own modules take as an activation elsewhere (a name such as ``"gelu"``, a
    function such as ``F.gelu``, as ``nn.TransformerEncoderLayer`` takes) is not a factory:
    calling it with no argument fails inside torch with a message that names neither the
    argument nor the fix, so it is refused here by name.
    """
    hint = "a class such as nn.GELU, or a lambda such as lambda: nn.GELU(approximate='tanh')"
    check(fn, callable(make), f"{arg} must be a factory that makes a module ({hint}), got {make!r}")
    try:
        return make()
    except TypeError as e:
        # A function of the hidden units (F.gelu, torch.tanh) needs its input: it is not a factory.
        raise BlockDiagError(
            f"{fn}: {arg} must be a factory that makes a module when called with no argument ({hint}); "
            f"calling {getattr(make, '__name__', repr(make))}() raised TypeError: {e}"
        ) from e


def _frozen_trace(x: torch.Tensor, layers: Sequence[GroupedLinear]) -> bool:
    """Whether this call is traced for an inference graph that inductor's freezing may fold.

    ``torch._inductor.config.freezing`` is read only where torch has imported it (it does to
    compile); freezing folds a graph's parameters only where nothing in it needs a gradient.
    """
    if not torch.compiler.is_compiling():
        return False
    cfg = sys.modules.get("torch._inductor.config")
    if cfg is None or not cfg.freezing:
        return False
    if not torch.is_grad_enabled():
        return True
    return not x.requires_grad and not any(
        t is not None and t.requires_grad for layer in layers for t in layer._parameters.values())


# How plan() starts the reason where auto's own checks rule the chain out, before any table.
_NOT_ALLOWED = "the chain is not allowed here: "


class GroupedMLP(StrategyChoice, nn.Module):
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
      model whose layers have hooks, parametrizations (pruning, ``weight_norm``) or a forward
      of their own (a subclass's, or one set on the instance), whose
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
      in training where ``EAGER_HEADS_RULE`` says (large blocks, many heads, large batches)
      or ``HEADS_MIN_HIDDEN_BYTES`` does (a hidden layer of 32 MB or more over every head,
      every grouped block of 64 * 64 elements or more, 256 rows or more).
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
            (``lambda: nn.Sequential(nn.ReLU(), nn.Dropout(0.1))``). A module put in
            later (``model.activations[k] = ...``, ``model.output_activation = ...``) is
            checked alike.
        output_activation: None (the default: the heads end with their last Linear), or a
            factory of the same kind for a module applied to every head's output (an RL
            actor's ``nn.Tanh``). It runs on ``[..., heads * out]``, so it must be
            element-wise as well.
        bias: learn biases: one bool for every layer, or one per layer (``[True, False]``
            for a last layer without bias).
        shared_input: see above.
        backend: ``"auto"`` or a registered backend name for every layer (settable later).
        strategy: ``"auto"``, ``"layers"``, ``"fm_chain"`` or ``"heads"`` (settable later), see above.
        device: factory kwarg, as for ``nn.Linear``.
        dtype: factory kwarg, as for ``nn.Linear``.

    Raises:
        BlockDiagError: non-positive sizes, an unknown backend or strategy, an activation
            argument that is not a factory (a name such as ``"gelu"``, a function such as
            ``F.gelu``), or an activation that is not stateless and element-wise.
    """

    # Declared for type checkers: the constructor stores the sizes it checked as ints.
    in_features: int
    hidden_features: tuple[int, ...]
    out_features: int
    heads: int
    shared_input: bool

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
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        fn = type(self).__name__
        check_dtype(fn, dtype)
        in_features, out_features, heads = as_size(in_features), as_size(out_features), as_size(heads)
        hidden_features = as_size(hidden_features)
        try:
            hidden = [hidden_features] if isinstance(hidden_features, int) else [as_size(s) for s in hidden_features]
        except TypeError:  # not iterable: 4.0, None
            hidden = [hidden_features]
        sizes = [in_features, *hidden, out_features]
        check(
            fn,
            all(is_int(s, 1) for s in sizes),
            f"in_features, hidden_features and out_features must be positive ints, got {sizes}",
        )
        check(fn, is_int(heads, 1), f"heads must be a positive int, got {heads!r}")
        if backend != "auto":  # here, or the first layer refuses it as "GroupedLinear.backend"
            get(backend, fn)
        self.in_features, self.hidden_features, self.out_features = in_features, tuple(hidden), out_features
        self.heads = heads
        self.shared_input = shared_input
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
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
        acts = [_make_activation(fn, "activation", activation) for _ in hidden]
        for k, act in enumerate(acts):
            _check_activation(fn, act, f"activation() after hidden layer {k}")
        self.activations = Activations(acts)
        out_act = None
        if output_activation is not None:
            out_act = _make_activation(fn, "output_activation", output_activation)
            _check_activation(fn, out_act, "output_activation()")
        self.output_activation = out_act
        self.backend = backend
        self.strategy = strategy
        self._decisions: dict = {}

    def __setattr__(self, name: str, value: object) -> None:
        # The activations are checked where they are put in, as the constructor checks what
        # its factories make: assigned later, a module that is not stateless and element-wise
        # (a per-head Softmax meant as output_activation) would run on every head's units at
        # once in each strategy's own layout, and so compute something else in each, silently.
        if name == "output_activation" and value is not None:
            _check_activation(f"{type(self).__name__}.output_activation", value, "output_activation")
        elif name == "activations" and (isinstance(value, nn.Module) or "activations" in self._modules):
            fn = f"{type(self).__name__}.activations"
            n = len(self.hidden_features)
            check(fn, isinstance(value, nn.ModuleList) and len(value) == n,
                  f"activations must be an nn.ModuleList of one activation per hidden layer ({n}), got "
                  + (f"one of {len(value)}" if isinstance(value, nn.ModuleList) else f"a {type(value).__name__}"))
            for k, act in enumerate(value):
                _check_activation(fn, act, f"activations[{k}]")
            if type(value) is nn.ModuleList:
                value.__class__ = Activations  # it checks a later replacement of one (no state of its own)
            elif not isinstance(value, Activations):  # a ModuleList of the caller's own class: the same modules
                training, value = value.training, Activations(value)
                value.training = training
        super().__setattr__(name, value)

    def __getstate__(self) -> dict:
        # nn.Module's: it drops ``model.compile()``'s ``_compiled_call_impl``, which wraps this
        # instance's ``_call_impl``. Kept, a deepcopy ran the original's weights, and pickle failed.
        state = super().__getstate__()
        state["_decisions"] = {}  # a cache: rebuilt where the model is loaded
        acts = state["_modules"].get("activations")
        if isinstance(acts, Activations):
            # Pickled as the plain ModuleList it was (the same modules), so that a whole-module
            # torch.save loads where ModuleList is allowed (weights_only): __setstate__ wraps it again.
            plain = nn.ModuleList.__new__(nn.ModuleList)
            plain.__dict__.update(acts.__dict__)
            state["_modules"] = {**state["_modules"], "activations": plain}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # Pickles from before ``strategy`` existed ran the chain under "auto"/"bmm".
        self.__dict__.setdefault("_strategy", "auto")
        self.__dict__.setdefault("_decisions", {})
        acts = self._modules.get("activations")
        if type(acts) is nn.ModuleList:  # as pickled (see __getstate__), or by a version before Activations
            acts.__class__ = Activations

    @property
    def backend(self) -> str:
        """``"auto"`` or a backend name; setting it sets every layer's backend too.

        Read from the layers: ``"mixed"`` once layers were given different backends
        (``model.layers[k].backend = ...``).
        """
        names = {layer.backend for layer in self.layers}
        return names.pop() if len(names) == 1 else "mixed"

    @backend.setter
    def backend(self, name: str) -> None:
        if name != "auto":
            get(name, f"{type(self).__name__}.backend")
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
        if type(x) is not torch.Tensor and fx_tracer(x) is not None:
            y = self._forward_fx(x)
        else:
            try:
                y = self._forward(x)
            except Exception:
                # The clear error for a sparse, nested or non-tensor input, which fails inside
                # first (no per-call check: a try costs nothing until it raises).
                check_operand_kinds(type(self).__name__, input=x)
                # Or for an input of another dtype or device than the parameters, which the
                # first layer refused in its own name ("GroupedLinear: weight has dtype ...").
                # A forced fm_chain or heads refused it already, in the model's name.
                if self._strategy not in ("fm_chain", "heads"):
                    self._refuse_foreign_input(type(self).__name__, x)
                    # Or for layers of different dtypes or devices, which a later layer refused
                    # in its own name.
                    mixed = self._mixed_parameter(type(self).__name__, x)
                    check(type(self).__name__, mixed is None, mixed)
                # Or for a parameter of another shape put in a layer's parameter dict
                # (torch.func.functional_call): the chain and the heads failed in torch's views.
                for k, layer in enumerate(self._modules["layers"]._modules.values()):
                    if not isinstance(layer, GroupedLinear):
                        continue
                    p = layer._parameters
                    refuse_replaced_shapes(type(self).__name__, layer, p.get("weight"), p.get("bias"), f"layers[{k}].")
                raise
        out = self._modules.get("output_activation")
        return y if out is None else out(y)

    def _forward_fx(self, x) -> object:
        """``torch.fx.symbolic_trace``'s forward: the layers and activations, called in turn.

        A Proxy has no shape, dtype or value to choose a strategy with, and the choice is made
        per call; the traced module runs what ``strategy="layers"`` runs (the same values),
        each layer's product recorded as a ``grouped_linear`` call (see :class:`GroupedLinear`),
        each activation as a call of its module.
        """
        acts = tuple(self._modules["activations"]._modules.values())
        for k, layer in enumerate(self._modules["layers"]._modules.values()):
            x = layer(x)
            if k < len(acts):
                # As in the layers' path, a random activation gets rows (a layer's output may be
                # feature-major); whether it is random is known only when it runs (training).
                if any(isinstance(m, (nn.modules.dropout._DropoutNd, nn.RReLU)) for m in acts[k].modules()):
                    x = x.contiguous()
                x = acts[k](x)
        return x

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
            why = self._forced_refusal(x, strategy, traced=torch.compiler.is_compiling())
            check(type(self).__name__, why is None, why)
            return self._forward_feature_major(x) if strategy == "fm_chain" else self._forward_heads(x)
        acts = tuple(self._modules["activations"]._modules.values())
        n_act = len(acts)
        for k, layer in enumerate(self._modules["layers"]._modules.values()):
            x = layer(x)
            if k < n_act:
                # A random activation (Dropout, RReLU in training) draws its numbers in its
                # input's memory order, and a layer's output layout is its plan's (bmm_fm
                # returns a feature-major view), which follows the grad mode: a reentrant
                # checkpoint's no_grad forward and its recomputation with grad would draw
                # different masks. Such an activation is given rows in both.
                if not x.is_contiguous() and _random(acts[k]):
                    x = x.contiguous()
                x = acts[k](x)
        return x

    def _refuse_foreign_input(self, fn: str, x: object) -> None:
        """Refuse ``x`` if its dtype or device is not the first layer's weight's, naming the model.

        The layers' path (``auto``, ``"layers"``) and ``plan`` fail inside the first layer,
        whose error names a ``GroupedLinear`` and its ``weight`` that the user never built,
        and asks to cast "them" to one dtype. Under autocast the layer casts first, and its
        own error (or none) stands.
        """
        w = self._foreign_weight(x)
        if w is None:
            return
        self._refuse_erased(fn)
        dev = x.device.type
        if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
            return
        raise BlockDiagError(
            f"{fn}: layers[0].weight is {w.dtype} on {w.device} but the input is {x.dtype} on {x.device}; "
            f"{_strategy._foreign_fix(w)}"
        )

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
        # What forward refuses (a non-tensor, a sparse or nested input) the plan refuses too:
        # it read x.dim() of anything, and planned a sparse input as if it would run.
        check_operand_kinds(fn, input=x)
        n_in = self.in_features * (1 if self.shared_input else self.heads)
        check(fn, x.dim() >= 1 and x.shape[-1] == n_in, f"input has shape {tuple(x.shape)}; its last dimension must be {n_in}")
        self._refuse_foreign_input(fn, x)
        mixed = self._mixed_parameter(fn, x)
        check(fn, mixed is None, mixed)
        # The caller's grad mode: saved-tensor hooks rule the chain out only where autograd
        # records, also where the strategy is decided as in training (see _auto_strategy).
        recorded = torch.is_grad_enabled()
        if not recorded and self._strategy == "auto" and self._random_acts():
            with torch.enable_grad():  # auto decides as in training here (see _auto_strategy)
                decided = self._plan(fn, x, recorded)
            # Only the strategy is decided as in training: where it is the layers, each layer
            # still plans for the grad mode it runs in (no_grad: inference), so the layer plans
            # reported are those, not the training plans the decision compared.
            reason = decided.reason
            if not reason.startswith(_NOT_ALLOWED):
                reason = ("decided as in training, as a random activation (Dropout, RReLU in training) draws "
                          f"its numbers in the strategy's layout; each layer runs its no_grad plan: {reason}")
            return dataclasses.replace(decided, layers=self._layer_plans(x), reason=reason)
        return self._plan(fn, x, recorded)

    def _plan(self, fn: str, x: torch.Tensor, recorded: bool) -> MLPPlan:
        """:meth:`plan` after its checks; ``recorded``: whether autograd records in the caller's grad mode."""
        plans = self._layer_plans(x)
        if self._strategy == "layers":
            return MLPPlan("layers", "layers", "fixed by the user (strategy='layers')", layers=plans)
        if self._strategy in ("fm_chain", "heads"):
            s_ = self._strategy
            why = self._forced_refusal(x, s_)
            check(fn, why is None, why)
            return MLPPlan(s_, s_, f"fixed by the user (strategy={s_!r})", layers=plans)
        why = self._auto_context(x, recorded)
        if why is not None:
            return MLPPlan("layers", "auto", f"{_NOT_ALLOWED}{why}", layers=plans)
        if any(p.problem.requires_grad for p in plans) and self._eager_heads_pay(x):
            if self._eager_heads_rule(x):
                area, heads, rows = _strategy.EAGER_HEADS_RULE
                return MLPPlan("heads", "auto", (
                    f"allowed, in training, and every grouped block has at least {area} elements, with {heads} heads "
                    f"or more and {rows} rows or more (EAGER_HEADS_RULE): there the heads one after another were "
                    "faster than the chain and the layers in scripts/bench_mlp_heads.py's timings"), layers=plans)
            limit, least, fewest = _strategy.HEADS_MIN_HIDDEN_BYTES
            size = self._hidden_bytes(x.shape[:-1].numel(), x.element_size())
            return MLPPlan("heads", "auto", (
                f"allowed, in training, every grouped block has at least {least} elements, the batch at least "
                f"{fewest} rows, and a hidden layer's "
                f"output over every head is {size} bytes, at least {limit} (HEADS_MIN_HIDDEN_BYTES): glibc maps "
                "tensors that large afresh on every step, and the heads' hidden tensors are one head's"), layers=plans)
        chain, reason, chain_us, layers_us, plans = self._measured_choice(x)
        return MLPPlan("fm_chain" if chain else "layers", "auto", reason, chain_us, layers_us, plans)

    # ------------------------------------------------------------ the fused chain

    def _forward_feature_major(self, x: torch.Tensor) -> torch.Tensor:
        # The parameters are read from ``_parameters`` (where the chain's checks found them
        # plain), and the layers and activations from their containers' dicts: attribute
        # access through nn.Module.__getattr__ and slicing a ModuleList (a new module per
        # call) cost more than the small products here.
        if torch.compiler.is_compiling():
            # A jagged nested input fails the reshape below inside dynamo's fake-tensor run,
            # which raises its own TorchRuntimeError: forward's except never sees it, so the
            # check that names the input runs here, while tracing (nothing at run time).
            check_operand_kinds(type(self).__name__, input=x)
        layers = tuple(self._modules["layers"]._modules.values())
        acts = tuple(self._modules["activations"]._modules.values())
        lead = x.shape[:-1]
        # The rows counted, not -1: under vmap over an empty dimension the physical reshape
        # (vmap's size 0 in front) cannot infer -1 from 0 elements. A product of the sizes,
        # not Size.numel(), which makes an int of a symbolic batch (export's dynamic Dim).
        x2 = x.reshape(math.prod(lead), x.shape[-1])
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
        frozen = _frozen_trace(x, layers)
        for layer in layers:
            p = layer._parameters
            w, b = p["weight"], p["bias"]
            # [groups, out, in]; the shared first layer's one group holds every head's rows.
            w = w.view(hds, w.shape[0] * w.shape[1] // hds, w.shape[2])
            # Inductor's freezing folds the parameters into constants, and with max-autotune
            # its CPU GEMM template reads a constant that is a view at a storage offset (every
            # head's weight but the first) from the offset 0: every head computed with head 0's
            # weight. A copy per head is a constant of its own; freezing folds it at compile
            # time, so the frozen graph pays nothing for it.
            weights.append(tuple(torch.select_copy(w, 0, g) for g in range(hds)) if frozen else w.unbind(0))
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
        cls,
        heads: Sequence[nn.Module] | nn.ModuleList,
        *,
        shared_input: bool = True,
        backend: str = "auto",
        strategy: str = "auto",
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
                of identical structure (a bare ``nn.Linear`` counts as
                ``nn.Sequential(linear)``): ``Linear``, then any number of (activation, ``Linear``)
                pairs, then optionally an activation (``output_activation``), where an
                activation is one or more stateless element-wise modules (``ReLU``, or
                ``ReLU`` then ``Dropout``: several become one ``nn.Sequential``); all Linear
                shapes and bias flags equal across heads, every weight and bias on one device
                and dtype, and the same
                modules (type and settings) at each position. A parametrized ``Linear``
                (``mask_block_diagonal_``, ``parametrizations.weight_norm``,
                ``spectral_norm``) is copied as the weight it computes now; the
                parametrization is not carried over, so the model trains that weight itself
                and differs from the heads after a step.
            shared_input: whether every head reads all of ``x``.
            backend: for the new model.
            strategy: for the new model (``"auto"``, ``"layers"``, ``"fm_chain"`` or ``"heads"``).

        Returns:
            a ``GroupedMLP`` on the heads' device and dtype, activations deep-copied from
                ``heads[0]``. Its parameters are new tensors (no gradient, optimizer state
                or attribute of the heads' comes along): build the optimizer after
                converting, since one over the heads' parameters no longer trains anything.

        Raises:
            BlockDiagError: empty input, heads that differ in structure or shape (the
                message names the head and the position), or an activation with parameters
                or one that is not element-wise (PReLU, LayerNorm, Softmax, or a subclass
                of one of them).
        """
        return _heads.from_heads(cls, heads, shared_input=shared_input, backend=backend, strategy=strategy)

    def to_heads(self) -> nn.ModuleList:
        """The ``heads`` independent ``nn.Sequential`` MLPs this model computes (copies).

        >>> len(GroupedMLP(8, 4, 1, heads=3).to_heads())
        3

        Returns:
            an ``nn.ModuleList`` of ``heads`` ``nn.Sequential(Linear, act, ..., Linear[, act])``
                (activations deep-copied) on this model's device and dtype, their modules
                named as :meth:`from_heads`' heads named theirs, with new parameters (an
                optimizer over the model's does not train them). Hooks on the
                model or its layers are not carried over: each sees all heads at once, which
                no single head does; register them again where they belong.

        Raises:
            BlockDiagError: a distributed model (DTensor parameters, e.g. group parallel):
                ``blockdiag.distributed.gather_model`` it first, on every rank.
        """
        return _heads.to_heads(self)
