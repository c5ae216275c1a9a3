"""``GroupedMLP`` from and to a list of ``nn.Sequential`` heads, losslessly both ways."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Optional, Sequence

import torch
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from ..._checks import check, check_same_device_dtype
from ...ops._sharding import refuse_sharded
from ..linear import (_copy_state, _read_current, _refuse_shared_parameters, _requires_grad, check_plain_linear,
                      computing_once, replaced_call)
from .activations import _check_activation, _hooked


@computing_once
def from_heads(cls: type, heads: Sequence[nn.Module] | nn.ModuleList, *, shared_input: bool, backend: str, strategy: str):
    """:meth:`GroupedMLP.from_heads` (``cls``: the class to build)."""
    fn = "GroupedMLP.from_heads"
    # One head passed where the sequence of them belongs would fail below as "object is not
    # iterable", naming neither the argument nor the fix.
    check(fn, isinstance(heads, Iterable),
          f"heads must be a sequence of heads (nn.Sequential or nn.Linear), got one {type(heads).__name__}; "
          "for a single head pass [head]")
    # A dict iterates its keys: heads[0] was a str, with no word of the values.
    check(fn, not isinstance(heads, (Mapping, nn.ModuleDict)),
          f"heads is a {type(heads).__name__}, which iterates its keys; pass its values (list(heads.values())): "
          "to_heads gives them back as an nn.ModuleList, in that order")
    # A bare Linear is the one-layer head Sequential(Linear): wrapping it copies nothing, and
    # every check below then sees it as such (its hooks, mode, parametrizations).
    heads = [nn.Sequential(h) if isinstance(h, nn.Linear) else h for h in heads]
    check(fn, len(heads) > 0, "heads is empty")
    ref = list(heads[0]) if isinstance(heads[0], nn.Sequential) else None
    check(fn, ref is not None, f"heads[0] must be an nn.Sequential or an nn.Linear, got {type(heads[0]).__name__}")
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
        check(fn, mods is not None, f"heads[{h}] must be an nn.Sequential or an nn.Linear, got {type(head).__name__}")
        check(
            fn,
            type(head).forward is nn.Sequential.forward,
            f"heads[{h}] is a {type(head).__name__}, whose own forward is not nn.Sequential's: converting "
            "copies only its modules, so the grouped model would compute something else",
        )
        check(
            fn,
            "forward" not in vars(head),
            f"heads[{h}] has its forward replaced on the instance: converting copies only its modules, "
            "so the grouped model would compute nn.Sequential's forward instead",
        )
        call = replaced_call(head)
        check(fn, call is None,
              f"heads[{h}] {call}: converting copies only its modules, so the grouped model would "
              "compute nn.Sequential's forward instead")
        check(
            fn,
            len(mods) == len(ref),
            f"heads[{h}] has {len(mods)} modules but heads[0] has {len(ref)}",
        )
        refuse_sharded(fn, head, f"heads.{h}.")  # DTensor heads (FSDP2's hooks too): gather them first
        check(fn, not _hooked(head), f"heads[{h}] has forward or backward hooks, which the grouped model would not run")
        check(fn, head.training == heads[0].training,
              f"heads[{h}] is in {_mode(head)} mode but heads[0] is in {_mode(heads[0])} mode")
        for k, (m, r) in enumerate(zip(mods, ref)):
            # A parametrized module's class is made for it alone (masked Linears): its own class counts.
            check(
                fn,
                type_before_parametrizations(m) is type_before_parametrizations(r),
                f"heads[{h}][{k}] is {type(m).__name__} but heads[0][{k}] is {type(r).__name__}",
            )
            check(fn, m.training == r.training,
                  f"heads[{h}][{k}] is in {_mode(m)} mode but heads[0][{k}] is in {_mode(r)} mode")
            if isinstance(r, nn.Linear):
                check_plain_linear(fn, m, f"heads[{h}][{k}]")
                check(
                    fn,
                    m.weight.shape == r.weight.shape and (m.bias is None) == (r.bias is None),
                    f"heads[{h}][{k}] is Linear with weight {tuple(m.weight.shape)} "
                    f"bias={m.bias is not None}, but heads[0][{k}] has weight "
                    f"{tuple(r.weight.shape)} bias={r.bias is not None}",
                )
                check(fn, _requires_grad(m) == _requires_grad(r),
                      f"heads[{h}][{k}] has requires_grad {_requires_grad(m)} but heads[0][{k}] has "
                      f"{_requires_grad(r)}: each grouped layer holds one parameter for every head")
                # The model holds one dtype and device, heads[0][0].weight's: a Linear or a bias in
                # another would be cast or moved silently by the copies below, not converted losslessly.
                w0 = ref[0].weight
                check_same_device_dtype(fn, **{"heads[0][0].weight": w0, f"heads[{h}][{k}].weight": m.weight,
                                               f"heads[{h}][{k}].bias": m.bias})
            else:
                _check_activation(fn, m, f"heads[{h}][{k}]")
                hooked = next((sub for sub in m.modules() if _hooked(sub)), None)
                check(fn, hooked is None, f"heads[{h}][{k}] has forward or backward hooks"
                      f"{'' if hooked is m else ' on a module inside it'}, which the grouped model would not run")
                why = _activation_differs(m, r)
                check(fn, why is None, f"heads[{h}][{k}] is {m!r} but heads[0][{k}] is {r!r}{why or ''}")
    _refuse_shared_parameters(fn, [(f"heads[{h}][{k}]", list(head)[k]) for h, head in enumerate(heads) for k in at])
    lins0 = [ref[k] for k in at]
    for a, b in zip(at, at[1:]):
        # Sizes from the weights (what the head computes), each Linear fed by the one before.
        check(fn, ref[b].weight.shape[1] == ref[a].weight.shape[0],
              f"heads[0][{b}] takes {ref[b].weight.shape[1]} inputs (weight {tuple(ref[b].weight.shape)}) but "
              f"heads[0][{a}] gives {ref[a].weight.shape[0]} (weight {tuple(ref[a].weight.shape)}): the head cannot run")
    # GroupedMLP's own refusal would list the sizes only: name the Linear and its shape.
    for k in at:
        check(fn, 0 not in ref[k].weight.shape,
              f"heads[0][{k}] has weight shape {tuple(ref[k].weight.shape)}: every Linear of a GroupedMLP "
              "needs at least one input and one output feature")
    bias = [lin.bias is not None for lin in lins0]
    sizes = [lins0[0].weight.shape[1]] + [lin.weight.shape[0] for lin in lins0]
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
        if len(ms) == 1 and type(ms[0]) is not nn.Sequential:
            return ms[0]
        seq = nn.Sequential(*ms)
        seq.training = heads[0].training  # a container the heads did not have: their mode
        return seq

    # The heads' training mode; the activations are copies and keep their own.
    model.train(heads[0].training)
    model.activations = nn.ModuleList(steps(ms) for ms in between)
    model.activations.training = heads[0].training
    model.output_activation = steps(last) if last else None
    with torch.no_grad():
        for k, layer in enumerate(model.layers):
            lins = [list(head)[at[k]] for head in heads]
            layer.weight.copy_(torch.stack([lin.weight for lin in lins]).reshape(layer.weight.shape))
            if bias[k]:
                layer.bias.copy_(torch.cat([lin.bias for lin in lins]))
    for layer, lin in zip(model.layers, lins0):  # training flags, frozen parameters
        _copy_state(lin, layer)
    names = tuple(heads[0]._modules)
    if names != tuple(str(k) for k in range(len(names))):
        # A head's own names (Sequential(OrderedDict(fc1=...))) are its state_dict keys and
        # attributes: to_heads names the modules it gives back so, not by position.
        model._head_names = names
        model._head_linears = tuple(at)  # where the names hold a Linear (see to_heads)
    return model


def _mode(m: nn.Module) -> str:
    return "training" if m.training else "eval"


# What nn.Module.__init__ (and Module.compile) keep in every instance's __dict__: its own
# bookkeeping (the parameter, buffer and module dicts, hooks), not a module's settings.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"_compiled_call_impl"}


def _activation_differs(m: nn.Module, r: nn.Module) -> Optional[str]:
    """Why activation ``m`` does not act as ``r`` (None where it does): one module serves every head.

    Their reprs, then for each module inside, its training mode and every attribute of its
    own but nn.Module's bookkeeping: a module of the caller's own may keep its settings there
    and not show them in its repr, under a private name (``self._alpha``) as well.
    """
    if m is r:
        return None
    if repr(m) != repr(r):
        return ""
    for a, b in zip(m.modules(), r.modules()):
        if a.training != b.training:
            return f" (in {_mode(a)} mode, the other in {_mode(b)} mode)"
        for name in sorted(set(vars(a)) | set(vars(b))):
            if name in _MODULE_INTERNALS:
                continue
            va, vb = getattr(a, name, None), getattr(b, name, None)
            if not _same_setting(va, vb):
                return f" (their {name} differ: {va!r} and {vb!r})"
    return None


def _same_setting(va: object, vb: object) -> bool:
    """Whether two values of an activation's attribute are the same setting (NaN equal to NaN)."""
    if va is vb:
        return True
    if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
        return (va.shape == vb.shape and va.dtype == vb.dtype and va.device == vb.device
                and (torch.equal(va, vb) or (va.is_floating_point() and bool(
                    torch.isclose(va, vb, rtol=0, atol=0, equal_nan=True).all()))))
    if isinstance(va, float) and isinstance(vb, float) and va != va and vb != vb:
        return True
    same = va == vb
    return isinstance(same, bool) and same


def to_heads(model) -> nn.ModuleList:
    """:meth:`GroupedMLP.to_heads`."""
    refuse_sharded("GroupedMLP.to_heads", model)
    sizes = [model.in_features, *model.hidden_features, model.out_features]
    out = nn.ModuleList()
    # Each layer's weight and bias read once: a parametrized one is computed on every read
    # (spectral_norm steps its power iteration), and every head must come from the one value;
    # a pruned one as the next forward computes it (see _read_current).
    read = [(_read_current(layer, "weight"), _read_current(layer, "bias")) for layer in model.layers]
    for h in range(model.heads):
        mods: list[nn.Module] = []
        for k, layer in enumerate(model.layers):
            o, i = sizes[k + 1], sizes[k]
            weight, bias = read[k]
            lin = nn.Linear(i, o, bias=bias is not None, device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                lin.weight.copy_(weight.reshape(model.heads, o, i)[h])
                if bias is not None:
                    lin.bias.copy_(bias[h * o:(h + 1) * o])
            _copy_state(layer, lin, read[k])
            mods.append(lin)
            if k < len(model.activations):
                act = copy.deepcopy(model.activations[k])
                # A Sequential of activations (from_heads' ReLU then Dropout) goes back
                # into the head as its modules, as the head it came from had them.
                mods.extend(act if type(act) is nn.Sequential else (act,))
        out_act = model._modules.get("output_activation")
        if out_act is not None:
            out_act = copy.deepcopy(out_act)
            mods.extend(out_act if type(out_act) is nn.Sequential else (out_act,))
        # The names from_heads found, while the model still has as many modules per head, each
        # Linear where a Linear was named: an activation replaced by one of another length
        # (model.activations[k] = ...) would otherwise give a Linear an activation's name.
        names = model.__dict__.get("_head_names")
        at = model.__dict__.get("_head_linears")
        if (names and len(names) == len(mods)
                and (at is None or tuple(k for k, m in enumerate(mods) if isinstance(m, nn.Linear)) == at)):
            head = nn.Sequential(OrderedDict(zip(names, mods)))
        else:
            head = nn.Sequential(*mods)
        head.training = model.training
        out.append(head)
    return out
