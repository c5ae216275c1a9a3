"""Which modules ``GroupedMLP`` takes as activations, and how its fused paths run them.

One activation module serves every head, so it must be stateless and element-wise; the
fused paths (the chain, the heads) run it in place on their own hidden tensors where nothing
differentiates the call.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..._checks import check

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
    """``act`` as a function that overwrites its input where it has an in-place form, else ``act``.

    The in-place form stands for the class's own forward: a module whose forward is set on
    the instance (a monkeypatch, a library's wrapper) or that has hooks runs as the module,
    since ``__call__`` would run that forward or those hooks and the shortcut would not.
    """
    if _own_call(act):
        return act
    if type(act) is nn.Sequential:
        # A step's input is a tensor the chain owns when it is the hidden product or what a
        # torch.nn step returned from an owned input (that input, overwritten or not, or a
        # new tensor); a module of the caller's own might return a tensor it keeps, and no
        # step after it is made in place: a torch.nn step may pass that tensor on (Identity,
        # Dropout in eval), and a nested Sequential returns what its own steps do.
        steps, owned = [], True
        for m in act:
            steps.append(_in_place(m) if owned else m)
            owned = owned and _returns_owned(m)

        def run(h: torch.Tensor) -> torch.Tensor:
            for step in steps:
                h = step(h)
            return h

        return run
    make = _IN_PLACE.get(type(act))
    return act if make is None else make(act)


def _own_call(act: nn.Module) -> bool:
    """Whether calling ``act`` runs more than its class's forward: one set on the instance, or hooks."""
    return "forward" in vars(act) or _act_hooked(act)


def _returns_owned(m: nn.Module) -> bool:
    """Whether ``m`` returns a tensor the chain owns whenever its input is one: torch.nn code only.

    A torch.nn module returns its input or a new tensor; a Sequential does when each of its
    steps does. A forward set on the instance is the caller's code, whatever the class.
    """
    if not _is_torch_nn(type(m)) or "forward" in vars(m):
        return False
    return type(m) is not nn.Sequential or all(_returns_owned(s) for s in m)


def _act_hooked(act: nn.Module) -> bool:
    """Whether ``act`` or a module inside it (a Sequential's steps) has hooks."""
    return _hooked(act) or (bool(act._modules) and any(_hooked(m) for m in act.modules()))


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _random(act: nn.Module) -> bool:
    """Whether ``act`` (or a step inside it) draws random numbers: a Dropout or RReLU in training."""
    return any(
        m.training and isinstance(m, (nn.modules.dropout._DropoutNd, nn.RReLU)) and getattr(m, "p", 1.0) != 0
        for m in act.modules()
    )


class Activations(nn.ModuleList):
    """``GroupedMLP.activations``: a ``ModuleList`` that checks a module put in its place.

    ``model.activations[k] = module`` replaces an activation after the model was built, where
    the constructor's check of what its factory made no longer runs: a module that is not
    stateless and element-wise (``Softmax``, ``LayerNorm``, ``PReLU``) would then run on every
    head's hidden units at once, in each strategy's own layout (the layers' ``[batch, heads *
    hidden]``, the chain's ``[heads, hidden, batch]``, one head's ``[batch, hidden]``), so
    each strategy, and ``to_heads``' heads, would compute something else. It is checked as the
    constructor checks it. It holds one activation per hidden layer, so adding or removing one
    (``append``, ``del``) is refused: the strategies would disagree on where it runs (the
    layers and the heads would apply an extra one after the last layer, the chain would not).
    Its ``repr`` names it ``ModuleList``, as it was.
    """

    def __init__(self, modules=()):
        super().__init__()
        for k, m in enumerate(modules):  # not through extend or add_module, which are refused
            nn.Module.add_module(self, str(k), m)

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, nn.Module) and name.isdigit():  # ModuleList.__setitem__ sets "<k>"
            _check_activation("GroupedMLP.activations", value, f"activations[{name}]")
        super().__setattr__(name, value)

    def add_module(self, name: str, module: Optional[nn.Module]) -> None:
        # add_module and register_module write the dict past __setattr__: a replacement there
        # is checked alike, and a new name would add an activation.
        if name not in self._modules:
            self._refuse_resize()
        _check_activation("GroupedMLP.activations", module, f"activations[{name}]")
        super().add_module(name, module)

    def _refuse_resize(self, *args, **kwargs):
        check("GroupedMLP.activations", False,
              f"it holds one activation per hidden layer ({len(self)}); replace one (model.activations[k] = "
              "module) instead of adding or removing one")

    append = extend = insert = pop = __delitem__ = __iadd__ = _refuse_resize

    def _get_name(self) -> str:
        return "ModuleList"
