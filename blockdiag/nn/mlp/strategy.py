"""How ``GroupedMLP`` chooses what runs: the strategies, the measured rules, the plan that explains itself.

The rules are constants here (each with the measurements it rests on); :class:`StrategyChoice`
holds the model's methods that apply them, eager and traced, and :class:`MLPPlan` is what
:meth:`GroupedMLP.plan <blockdiag.GroupedMLP.plan>` reports.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules import module as _nn_module
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..._checks import check_not_erased
from ... import settings as _settings
from ...dispatch import ONE_INPUT_RULE, UPCAST_RULE, Plan, half_upcast
from ...ops._define import saved_tensors_hooked
from ...ops.auto import route_token, traced_routes
from ..linear import GroupedLinear, _compile_guard
from .activations import _act_hooked, _hooked, _random

# How GroupedMLP runs its layers (see the class docstring): "layers" calls each layer
# (``GroupedLinear.__call__``, so hooks, parametrizations, pruning and FSDP2 see every call,
# and each layer's backend is planned by the chooser); "fm_chain" is the fused feature-major
# chain of addmm/baddbmm on the layers' parameters; "heads" runs each head's layers in turn,
# as the loop of nn.Sequential heads does, on views of the layers' parameters; "auto" takes
# the chain only where nothing observes or rewrites the layers and the measured table says
# it is faster, and the heads where TRACED_HEADS_RULE (traced) or EAGER_HEADS_RULE says.
STRATEGIES = ("auto", "layers", "fm_chain", "heads")


_PLAIN = (torch.Tensor, nn.Parameter)


# One C call for "is autocast on anywhere?" (private API, hence optional).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_on() -> bool:
    if _ANY_AUTOCAST is not None:
        return _ANY_AUTOCAST()
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda") if torch.amp.is_autocast_available(d))


def _plain(t: torch.Tensor, traced: bool) -> bool:
    """A plain tensor parameter, not a subclass such as DTensor (FSDP2's parameters).

    While tracing, parameters may be the tracer's own tensors (``torch.export`` passes
    FakeTensors): those are plain, a traceable wrapper subclass (DTensor) is not. A model
    built under ``FakeTensorMode`` holds FakeTensor parameters outside any trace: those are
    plain too (they stand for plain tensors; the products compute shapes only).
    """
    return type(t) in _PLAIN or type(t) is FakeTensor or (traced and not is_traceable_wrapper_subclass(t))


@dataclass(frozen=True)
class MLPPlan:
    """What :class:`GroupedMLP` runs for an input, and why (``str(plan)`` is a report).

    Returned by :meth:`GroupedMLP.plan`.

    >>> import torch, blockdiag
    >>> plan = blockdiag.GroupedMLP(8, 4, 1, heads=3, strategy="layers").plan(torch.randn(5, 8))
    >>> plan.strategy, plan.requested, len(plan.layers)
    ('layers', 'layers', 2)

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


# Eager ``auto`` also runs the heads on a device type in HEADS_DEVICES, in training, where a
# hidden layer's output over every head comes to at least the first number of bytes, every
# grouped block to at least the second number of elements and the batch to at least the third
# number of rows. Above 32 MB glibc's malloc serves every allocation from a fresh mmap (its
# dynamic threshold stops there), so each tensor the chain or the layers make at the hidden
# width (the product, the activation, their gradients) faults its pages in again on every
# step, where a head's hidden tensors are small and reused from the heap, as the nn.Linear
# loop's are. The floors keep the heads' per-call cost out: with small blocks, or many heads
# of few rows over the same bytes, the heads were slower than the layers in the timings of
# ``blockdiag bench --compiled`` (its mlp model) and of the shapes this rule was set from
# (the changelog of 2026-12-07 names them).
HEADS_MIN_HIDDEN_BYTES = (32 << 20, 64 * 64, 256)


def _own_forward(layer: nn.Module) -> Optional[str]:
    """Where calling ``layer`` runs a forward other than :class:`GroupedLinear`'s (None where it does not).

    The chain and the heads read the layer's parameters and never call it, so a forward of
    its own (a subclass's, or one set on the instance, as a wrapper library sets it) would
    be skipped silently: the product of the plain weight would be computed instead.
    """
    if "forward" in layer.__dict__:
        return "a forward set on the instance"
    if type(layer).forward is not GroupedLinear.forward:
        return f"{type(layer).__name__}'s own forward"
    return None


class StrategyChoice:
    """``GroupedMLP``'s choice of strategy (a mixin: the model's own state, read where it decides)."""

    def _chain_refusal(self, x: torch.Tensor, traced: bool = False, strategy: str = "fm_chain") -> Optional[str]:
        """Why ``strategy`` (``"fm_chain"`` or ``"heads"``, which both read the parameters and
        call no layer) would skip or break something here (None: it runs as the layers would).

        Checked on every call: hooks and parametrizations can be added at any time.
        """
        if strategy == "heads":
            return self._params_refusal(x, traced, "the heads strategy",
                                        "one head's [batch, hidden] at a time instead of every head's")
        return self._params_refusal(x, traced, "the chain", "the chain's feature-major [heads, hidden, batch] layout")

    def _forced_refusal(self, x: torch.Tensor, strategy: str, traced: bool = False) -> Optional[str]:
        """The error for ``strategy`` (``"fm_chain"`` or ``"heads"``, forced by the user) where it
        cannot run on ``x``, with what to do instead; None where it runs."""
        why = self._chain_refusal(x, traced=traced, strategy=strategy)
        if why is None:
            return None
        self._refuse_erased(type(self).__name__)
        w = self._foreign_weight(x)
        if w is not None:
            # The layers (and so auto) refuse such an input too: another strategy would not help.
            return f"strategy={strategy!r} cannot run: {why}; {_foreign_fix(w)}"
        mixed = self._mixed_parameter(type(self).__name__, x)
        if mixed is not None:  # nor would the layers run it
            return f"strategy={strategy!r} cannot run: {mixed}"
        return f"strategy={strategy!r} cannot run: {why}; use strategy='layers' or 'auto'"

    def _mixed_parameter(self, fn: str, x: torch.Tensor) -> Optional[str]:
        """Why no strategy runs this model, where a layer's parameter has another dtype or device
        than ``layers[0].weight`` (None where none has).

        Nothing casts between the layers, so the second such layer gets its predecessor's
        output in the first one's dtype: its own error named a ``GroupedLinear`` and asked to
        cast "them" to one dtype, and a forced chain or heads advised the layers, which fail
        alike. ``load_state_dict(assign=True)`` keeps a checkpoint's dtypes, so a mixed
        checkpoint (or ``model.layers[k].half()``) makes such a model. Autocast casts every
        layer's operands, so it runs there: None under autocast on ``x``'s device.
        """
        if _autocasting(x):
            return None
        layers = tuple(self._modules["layers"]._modules.values())
        ref = layers[0]._parameters.get("weight") if layers else None
        if not isinstance(ref, torch.Tensor):
            return None
        for k, layer in enumerate(layers):
            for name, p in layer._parameters.items():
                if isinstance(p, torch.Tensor) and (p.dtype != ref.dtype or p.device != ref.device):
                    self._refuse_erased(fn)  # freezing's erased parameters are on meta: named as such
                    to = ref.dtype if p.dtype != ref.dtype else repr(str(ref.device))
                    fix = (f"materialise it (model.to_empty(device={str(ref.device)!r}), then load_state_dict "
                           "or reset_parameters)" if p.is_meta and not ref.is_meta
                           else f"convert the model (model.to({to}))")
                    return (f"layers[{k}].{name} is {p.dtype} on {p.device} but layers[0].weight is "
                            f"{ref.dtype} on {ref.device}, and no strategy converts between layers "
                            f"(load_state_dict(assign=True) keeps a checkpoint's dtypes and devices): {fix}")
        return None

    def _refuse_erased(self, fn: str) -> None:
        """Raise if ``torch.compile``'s freezing discarded a layer's parameter (see ``check_not_erased``).

        Such a parameter is a meta-device subclass, which the refusals would otherwise call
        an input on another device or a DTensor.
        """
        check_not_erased(fn, **{f"layers[{k}].{n}": p
                                for k, layer in enumerate(self._modules["layers"]._modules.values())
                                for n, p in layer._parameters.items()})

    def _foreign_weight(self, x: object) -> Optional[torch.Tensor]:
        """The first layer's weight where ``x``'s dtype or device is not its own, else None."""
        first = next(iter(self._modules["layers"]._modules.values()), None)
        w = None if first is None else first._parameters.get("weight")
        if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and (w.dtype != x.dtype or w.device != x.device):
            return w
        return None

    def _params_refusal(self, x: torch.Tensor, traced: bool, who: str, activation_sees: str) -> Optional[str]:
        mm = _nn_module
        if mm._global_forward_hooks or mm._global_forward_pre_hooks or mm._global_backward_hooks or mm._global_backward_pre_hooks:
            # Named: the user may have registered none (FlopCounterMode's module tracker does).
            hooks = (*mm._global_forward_pre_hooks.values(), *mm._global_forward_hooks.values(),
                     *mm._global_backward_pre_hooks.values(), *mm._global_backward_hooks.values())
            names = dict.fromkeys(f"{getattr(h, '__module__', None) or '?'}.{getattr(h, '__qualname__', type(h).__name__)}"
                                  for h in hooks)
            return (f"a global module hook is registered (torch.nn.modules.module.register_module_*_hook: "
                    f"{', '.join(names)}; FlopCounterMode registers such hooks while it counts), "
                    f"and {who} calls no layer")
        # Dtypes are compared for every parameter, the device for the first weight only: a
        # parameter elsewhere on another device fails on either path, and each comparison
        # of devices costs a device object. Except on meta: torch's products take a meta
        # operand beside CPU ones and return a CPU tensor of uninitialised memory (or a meta
        # one), so a layer left on meta (a meta-device model loaded with a checkpoint that
        # lacks it) ran silently; ``is_meta`` is a flag, not a device object.
        dt = x.dtype
        x_meta = x.is_meta
        for k, layer in enumerate(self._modules["layers"]._modules.values()):
            params = layer._parameters
            w = params.get("weight")
            # Before the hooks: group parallelism and FSDP2 hook the layers they distribute,
            # and the parameters are the reason to name.
            if w is not None and not _plain(w, traced):
                return (f"layers[{k}].weight is not a plain tensor parameter (a DTensor of group parallelism or "
                        "FSDP2, or another subclass)")
            if _hooked(layer):
                return (
                    f"layers[{k}] has forward or backward hooks (torch.nn.utils.prune and the old "
                    f"weight_norm use them too), and {who} never calls the layer"
                )
            own = _own_forward(layer)
            if own is not None:
                return f"layers[{k}] runs {own}, and {who} never calls the layer"
            if "parametrizations" in layer._modules:
                return f"layers[{k}] is parametrized (torch.nn.utils.parametrize), and {who} reads the raw parameters"
            if w is None:
                return f"layers[{k}].weight is not a registered parameter (rewritten)"
            if w.dtype != dt or (k == 0 and w.device != x.device):
                return f"layers[{k}].weight is {w.dtype} on {w.device} but the input is {dt} on {x.device}"
            if "bias" not in params:
                return f"layers[{k}].bias is not a registered parameter (rewritten)"
            b = params["bias"]
            if b is not None and (not _plain(b, traced) or b.dtype != dt):
                return f"layers[{k}].bias is not a plain tensor parameter of the input's dtype"
            if not x_meta and (w.is_meta or (b is not None and b.is_meta)):
                return (f"layers[{k}].{'weight' if w.is_meta else 'bias'} is on meta (it holds no values) but "
                        f"the input is on {x.device}")
        for k, act in enumerate(self._modules["activations"]._modules.values()):
            if _act_hooked(act):
                return f"activations[{k}] has hooks, which would see {activation_sees}"
        return None

    def _auto_context(self, x: torch.Tensor, recorded: Optional[bool] = None) -> Optional[str]:
        """Why ``auto`` runs the layers whatever the table says, or None (the cheap checks first).

        ``recorded``: the grad mode the model is called in (default: the one in force), which
        decides whether saved-tensor hooks matter where the strategy is decided as in training.
        """
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
        if (torch.is_grad_enabled() if recorded is None else recorded) and saved_tensors_hooked():
            return ("saved-tensor hooks are in force (a non-reentrant checkpoint, save_on_cpu): its recomputation "
                    "must save what the forward saved, whether or not a global module hook is registered in "
                    "one of the two")
        for k, layer in enumerate(self._modules["layers"]._modules.values()):
            if layer._backend != "auto":
                return f"layers[{k}] has backend={layer._backend!r}, which is honoured"
        return self._chain_refusal(x)

    def _random_acts(self) -> bool:
        """Whether an activation draws random numbers now (a Dropout or RReLU in training).

        Those numbers are drawn in the layout of the strategy that runs, so ``auto`` then
        decides as in training whatever the grad mode: a reentrant checkpoint runs the forward
        under ``no_grad`` and recomputes it with grad, and its gradients would otherwise be of
        another mask than the output it returned.
        """
        return any(_random(a) for a in self._modules["activations"]._modules.values())

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
            # A non-reentrant checkpoint matches the tensors its forward saved with those its
            # recomputation saves, and the strategies save different ones: a global module
            # hook (FlopCounterMode registers one) around only one of the two passes chose
            # the layers in it and the chain in the other, a CheckpointError in the backward.
            or (torch.is_grad_enabled() and saved_tensors_hooked())
        ):
            return "layers"
        mm = _nn_module
        if mm._global_forward_hooks or mm._global_forward_pre_hooks or mm._global_backward_hooks or mm._global_backward_pre_hooks:
            return "layers"
        dt = x.dtype
        acts = tuple(self._modules["activations"]._modules.values())
        # Under no_grad only (a walk over the activations' modules): see _random_acts.
        random_acts = not torch.is_grad_enabled() and self._random_acts()
        grad = torch.is_grad_enabled() or random_acts
        rg = grad and x.requires_grad
        mask, bit = 0, 1  # bit k: autograd records layer k's product
        dev = None
        for layer in self._modules["layers"]._modules.values():
            if (
                layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks or layer._backward_pre_hooks
                or "forward" in layer.__dict__ or type(layer).forward is not GroupedLinear.forward
                or layer._backend != "auto" or "parametrizations" in layer._modules
            ):
                return "layers"
            p = layer._parameters
            w = p.get("weight")
            if w is None or type(w) not in _PLAIN or w.dtype != dt or "bias" not in p or w.is_meta:
                return "layers"  # meta (x is not here): see _params_refusal
            if dev is None:
                dev = w.device
                if dev != x.device:
                    return "layers"
            b = p["bias"]
            if b is not None and (type(b) not in _PLAIN or b.dtype != dt or b.is_meta):
                return "layers"
            if grad and not rg:
                rg = w.requires_grad or (b is not None and b.requires_grad)
            if rg:
                mask |= bit
            bit <<= 1
        for act in acts:
            if _act_hooked(act):
                return "layers"
        # The epoch (blockdiag.dispatch's: settings, profile, registry, thread count) moves
        # whenever the table's answer may change, so an entry is never checked, only looked up.
        ep = _settings.epoch()
        key = (x.shape, dt, dev, mask, ep)
        chosen = self._decisions.get(key)
        if chosen is not None:
            return chosen
        with torch.enable_grad() if random_acts else contextlib.nullcontext():
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
        """``EAGER_HEADS_RULE`` or ``HEADS_MIN_HIDDEN_BYTES`` (shapes only; the caller checked the
        heads are allowed and in training), unless the layers compute in float32 where the
        heads' ``nn.Linear`` would run a half dtype's kernels (``UPCAST_RULE``)."""
        return (self._eager_heads_rule(x) or self._eager_heads_hidden(x)) and not half_upcast(x.device.type, x.dtype)

    def _eager_heads_rule(self, x: torch.Tensor) -> bool:
        area, heads, rows = EAGER_HEADS_RULE
        smallest = self._smallest_grouped_block()
        return (x.device.type in HEADS_DEVICES and smallest is not None and smallest >= area
                and self.heads >= heads and x.shape[:-1].numel() >= rows)

    def _eager_heads_hidden(self, x: torch.Tensor) -> bool:
        limit, least, fewest = HEADS_MIN_HIDDEN_BYTES
        smallest = self._smallest_grouped_block()
        rows = x.shape[:-1].numel()
        return (x.device.type in HEADS_DEVICES and smallest is not None and smallest >= least
                and rows >= fewest and self._hidden_bytes(rows, x.element_size()) >= limit)

    def _hidden_bytes(self, rows: int, itemsize: int) -> int:
        """The largest hidden layer's output over every head, in bytes (0 without a hidden layer)."""
        widths = [layer.out_features for layer in tuple(self._modules["layers"]._modules.values())[:-1]]
        return rows * max(widths, default=0) * itemsize

    def _traced_strategy(self, x: torch.Tensor) -> str:
        """``auto``'s strategy while dynamo traces: the heads where ``TRACED_HEADS_RULE`` says,
        else the chain where :meth:`_traced_runs_chain` says, else the layers."""
        if self._traced_runs_heads(x):
            return "heads"
        return "fm_chain" if self._traced_runs_chain(x) else "layers"

    def _traced_runs_heads(self, x: torch.Tensor) -> bool:
        """Whether a traced ``auto`` runs the heads (``TRACED_HEADS_RULE``, shapes only, no batch; or
        ``HEADS_MIN_HIDDEN_BYTES`` at a concrete batch)."""
        if x.device.type not in HEADS_DEVICES:
            return False
        layers = tuple(self._modules["layers"]._modules.values())
        smallest = self._smallest_grouped_block()
        if smallest is None or x.numel() == 0 or torch._C._are_functorch_transforms_active() or _autocast_on():
            return False
        if (not any(smallest >= area and (most is None or self.heads <= most) for area, most in TRACED_HEADS_RULE)
                and not self._traced_hidden_pays(x, smallest)):
            return False
        if any(layer._backend != "auto" for layer in layers):
            return False
        _compile_guard(_settings.generation, _settings._local.key)  # the table in force decides the next check
        if half_upcast(x.device.type, x.dtype):
            return False
        return self._chain_refusal(x, traced=True, strategy="heads") is None

    def _traced_hidden_pays(self, x: torch.Tensor, smallest: int) -> bool:
        """``HEADS_MIN_HIDDEN_BYTES`` in a traced training graph at a concrete batch (a graph
        serving every batch size keeps ``TRACED_HEADS_RULE``, which reads no batch)."""
        limit, least, fewest = HEADS_MIN_HIDDEN_BYTES
        if smallest < least or not torch.is_grad_enabled():
            return False
        if not (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return False
        rows = 1
        for size in x.shape[:-1]:  # not Size.numel(), which makes a symbolic batch a number
            rows = rows * size
        return _concrete(rows) and rows >= fewest and self._hidden_bytes(rows, x.element_size()) >= limit

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
        checks read (parameters, backends), so changing those recompiles; not on hooks by
        default (``torch._dynamo.config.skip_nnmodule_hook_guards``), as for any module: a hook
        added to a layer after compiling is honoured after ``torch._dynamo.reset()``.
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
        _compile_guard(_settings.generation, _settings._local.key)
        if half_upcast(x.device.type, x.dtype):
            return False  # the layers compute in float32, the chain in the half dtype (UPCAST_RULE)
        if not _concrete(rows):  # a symbolic batch: the graph serves every batch size
            return x.device.type in CHAIN_WHEREVER_ALLOWED
        # Decided as in training where a random activation runs (see _auto_strategy).
        grad = torch.is_grad_enabled() or self._random_acts()
        return _traced_measured_choice(self, rows, grad, x.requires_grad)

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
        upcast = [plan for plan in plans if plan.reason.startswith(UPCAST_RULE)]
        if upcast:
            return False, (f"the layers' {upcast[0].backend} computes {str(x.dtype).replace('torch.', '')} in "
                           "float32, where the chain would run torch's kernels of that dtype, which the table "
                           "(of another dtype) does not describe (UPCAST_RULE)"), chain_us, layers_us, plans
        one_input = [plan for plan in plans if plan.reason == ONE_INPUT_RULE]
        if one_input:
            return False, (f"a layer has one input per head ({one_input[0].problem.groups} heads of "
                           f"{one_input[0].problem.block_in}x{one_input[0].problem.block_out}, ONE_INPUT_RULE): the "
                           f"chain would run it as bmm_fm's GEMM with nothing to reduce, where the layer runs "
                           f"{one_input[0].backend}"), chain_us, layers_us, plans
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


def _traced_measured_choice(model: StrategyChoice, rows: int, grad: bool, input_grad: bool) -> bool:
    """:meth:`StrategyChoice._measured_choice` for ``rows`` input rows, outside dynamo's trace.

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


def _autocasting(x: object) -> bool:
    """Whether autocast is on for ``x``'s device type (the layers then cast their operands)."""
    dev = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    return torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)


def _foreign_fix(w: torch.Tensor) -> str:
    """What to do with an input of another dtype or device than the parameters (``w``)."""
    return (f"no strategy runs an input whose dtype or device is not the parameters': pass it as {w.dtype} "
            f"on {w.device}, or convert the model (model.to(...))")
