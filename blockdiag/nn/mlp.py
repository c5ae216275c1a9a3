"""``GroupedMLP``: ``heads`` independent MLPs (the forum's loop of heads) as one module."""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch import nn

from .._checks import check
from ..backends import get
from .linear import GroupedLinear

__all__ = ["GroupedMLP"]

# The torch.nn modules that act on each entry alone, with no state: the only ones GroupedMLP
# can apply to its hidden units, which it holds as [heads, hidden, batch] (feature-major) or
# [batch, heads * hidden]. A row-wise module (Softmax, LayerNorm) would mix the heads or run
# over the batch, and a module with parameters (PReLU) would share one head's parameters
# across all heads. Modules defined outside torch.nn are accepted when they hold no
# parameters or buffers; that they act element-wise is the caller's promise.
ELEMENTWISE_ACTIVATIONS = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.RReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Hardshrink,
    nn.Softshrink, nn.Tanhshrink, nn.Softplus, nn.Softsign, nn.LogSigmoid, nn.Threshold,
    nn.Identity, nn.Dropout, nn.AlphaDropout,
)


def _check_activation(fn: str, act: object, where: str) -> None:
    check(fn, isinstance(act, nn.Module), f"{where} must be an nn.Module, got {type(act).__name__}")
    state = [n for n, _ in act.named_parameters()] + [n for n, _ in act.named_buffers()]
    check(
        fn,
        not state,
        f"{where} is {act!r}, which holds parameters or buffers ({', '.join(state)}); one "
        "activation module serves every head, so only stateless element-wise activations can be grouped",
    )
    check(
        fn,
        isinstance(act, ELEMENTWISE_ACTIVATIONS) or not type(act).__module__.startswith("torch.nn"),
        f"{where} is {act!r}, which is not element-wise; GroupedMLP applies activations to "
        f"every head's hidden units at once, so only these torch.nn modules can be used: "
        f"{', '.join(c.__name__ for c in ELEMENTWISE_ACTIVATIONS)} (or a stateless element-wise module of your own)",
    )


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

    With ``backend="auto"`` (or ``"bmm"``) the hidden activations stay feature-major,
    ``[heads, hidden, batch]``, between layers: each layer is one ``baddbmm`` with the bias
    fused and no transpose or copy between layers; only the final output is transposed
    once into ``[batch, heads * out]``. Any other backend name runs each layer as a
    :class:`GroupedLinear` with that backend.

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
            torch.nn ones accepted).
        bias: learn biases.
        shared_input: see above.
        backend: ``"auto"`` or a registered backend name (settable later).
        device: factory kwarg, as for ``nn.Linear``.
        dtype: factory kwarg, as for ``nn.Linear``.

    Raises:
        BlockDiagError: non-positive sizes, an unknown backend, or an activation that is not
            stateless and element-wise.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int | Sequence[int],
        out_features: int,
        heads: int,
        *,
        activation: Callable[[], nn.Module] = nn.ReLU,
        bias: bool = True,
        shared_input: bool = True,
        backend: str = "auto",
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
        layers = []
        for k in range(len(sizes) - 1):
            if k == 0 and shared_input:
                layers.append(GroupedLinear(sizes[0], heads * sizes[1], 1, bias, backend=backend, **factory))
            else:
                layers.append(GroupedLinear(heads * sizes[k], heads * sizes[k + 1], heads, bias, backend=backend, **factory))
        self.layers = nn.ModuleList(layers)
        acts = [activation() for _ in hidden]
        for k, act in enumerate(acts):
            _check_activation(fn, act, f"activation() after hidden layer {k}")
        self.activations = nn.ModuleList(acts)
        self.backend = backend

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., heads * out]`` (``[..., heads * in]`` without ``shared_input``).

        Raises:
            BlockDiagError: an input whose last dimension, dtype or device does not fit.
        """
        n_in = self.in_features * (1 if self.shared_input else self.heads)
        check(
            type(self).__name__,
            x.dim() >= 1 and x.shape[-1] == n_in,
            f"input has shape {tuple(x.shape)}; its last dimension must be {n_in}"
            + ("" if self.shared_input else f" (heads={self.heads} x in_features={self.in_features})"),
        )
        w = self.layers[0].weight
        # The feature-major path has no checks of its own: an empty batch, or an input whose
        # dtype or device differs from the parameters' (autocast's mixed inputs included),
        # takes the per-layer path, where GroupedLinear handles it or says what is wrong.
        if (
            self._backend in ("auto", "bmm")
            and x.dtype == w.dtype
            and x.device == w.device
            and x.numel() > 0
        ):
            return self._forward_feature_major(x)
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if k < len(self.activations):
                x = self.activations[k](x)
        return x

    def _forward_feature_major(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        n, hds = x2.shape[0], self.heads
        first = self.layers[0]
        if self.shared_input:
            # One wide GEMM [H*h, in] @ [in, N]: x is read in place through its transpose.
            w = first.weight[0]
            h = torch.addmm(first.bias[:, None], w, x2.t()) if first.bias is not None else w @ x2.t()
            h = h.view(hds, -1, n)
        else:
            xv = x2.view(n, hds, self.in_features).permute(1, 2, 0)  # [H, in, N] view
            h = self._bmm(first, xv)
        for k, layer in enumerate(self.layers[1:]):
            h = self.activations[k](h)
            h = self._bmm(layer, h)
        # [H, out, N] -> [N, H*out]: the one transpose of the whole stack.
        return h.permute(2, 0, 1).reshape(*lead, hds * self.out_features)

    @staticmethod
    def _bmm(layer: GroupedLinear, h: torch.Tensor) -> torch.Tensor:
        if layer.bias is None:
            return torch.bmm(layer.weight, h)
        return torch.baddbmm(layer.bias.view(layer.groups, layer.block_out, 1), layer.weight, h)

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, in_features={self.in_features}, hidden={list(self.hidden_features)}, "
            f"out_features={self.out_features}, shared_input={self.shared_input}, backend={self.backend!r}"
        )

    @classmethod
    def from_heads(cls, heads: Sequence[nn.Module], *, shared_input: bool = True, backend: str = "auto") -> "GroupedMLP":
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
                pairs; all Linear shapes, bias flags, devices and dtypes equal across heads,
                and the same stateless element-wise activation (type and settings) at each
                position.
            shared_input: whether every head reads all of ``x``.
            backend: for the new model.

        Returns:
            a ``GroupedMLP`` on the heads' device and dtype, activations deep-copied from
            ``heads[0]``.

        Raises:
            BlockDiagError: empty input, heads that differ in structure or shape (the
                message names the head and the position), or an activation with parameters
                or one that is not element-wise (PReLU, LayerNorm, Softmax).
        """
        fn = "GroupedMLP.from_heads"
        heads = list(heads)
        check(fn, len(heads) > 0, "heads is empty")
        ref = list(heads[0]) if isinstance(heads[0], nn.Sequential) else None
        check(fn, ref is not None, f"heads[0] must be an nn.Sequential, got {type(heads[0]).__name__}")
        check(
            fn,
            len(ref) % 2 == 1 and all(isinstance(m, nn.Linear) for m in ref[::2])
            and not any(isinstance(m, nn.Linear) for m in ref[1::2]),
            "heads[0] must be Sequential(Linear, act, Linear, ..., act, Linear), got "
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
        lins0 = ref[::2]
        bias = lins0[0].bias is not None
        check(
            fn,
            all((lin.bias is not None) == bias for lin in lins0),
            "all Linear layers of a head must agree on bias (all with or all without)",
        )
        sizes = [lins0[0].in_features] + [lin.out_features for lin in lins0]
        w0 = lins0[0].weight
        model = cls(
            sizes[0], sizes[1:-1], sizes[-1], len(heads),
            bias=bias, shared_input=shared_input, backend=backend,
            device=w0.device, dtype=w0.dtype,
        )
        model.activations = nn.ModuleList(copy.deepcopy(m) for m in ref[1::2])
        with torch.no_grad():
            for k, layer in enumerate(model.layers):
                lins = [list(head)[2 * k] for head in heads]
                layer.weight.copy_(torch.stack([lin.weight for lin in lins]).reshape(layer.weight.shape))
                if bias:
                    layer.bias.copy_(torch.cat([lin.bias for lin in lins]))
        return model

    def to_heads(self) -> nn.ModuleList:
        """The ``heads`` independent ``nn.Sequential`` MLPs this model computes (copies).

        >>> len(GroupedMLP(8, 4, 1, heads=3).to_heads())
        3

        Returns:
            an ``nn.ModuleList`` of ``heads`` ``nn.Sequential(Linear, act, ..., Linear)``
            (activations deep-copied) on this model's device and dtype.
        """
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
                    mods.append(copy.deepcopy(self.activations[k]))
            out.append(nn.Sequential(*mods))
        return out
