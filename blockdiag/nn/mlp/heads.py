"""``GroupedMLP`` from and to a list of ``nn.Sequential`` heads, losslessly both ways."""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from ..._checks import check
from ...ops._sharding import refuse_sharded
from ..linear import check_plain_linear
from .activations import _check_activation


def from_heads(cls: type, heads: Sequence[nn.Module], *, shared_input: bool, backend: str, strategy: str):
    """:meth:`GroupedMLP.from_heads` (``cls``: the class to build)."""
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


def to_heads(model) -> nn.ModuleList:
    """:meth:`GroupedMLP.to_heads`."""
    refuse_sharded("GroupedMLP.to_heads", model)
    sizes = [model.in_features, *model.hidden_features, model.out_features]
    out = nn.ModuleList()
    for h in range(model.heads):
        mods: list[nn.Module] = []
        for k, layer in enumerate(model.layers):
            o, i = sizes[k + 1], sizes[k]
            lin = nn.Linear(i, o, bias=layer.bias is not None, device=layer.weight.device, dtype=layer.weight.dtype)
            with torch.no_grad():
                lin.weight.copy_(layer.weight.reshape(model.heads, o, i)[h])
                if layer.bias is not None:
                    lin.bias.copy_(layer.bias[h * o:(h + 1) * o])
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
        out.append(nn.Sequential(*mods))
    return out
