"""Group parallelism: the groups of ``GroupedLinear`` / heads of ``GroupedMLP`` sharded across ranks.

Import it explicitly (``import blockdiag.distributed``): it loads ``torch.distributed.tensor``,
which ``import blockdiag`` does not, and registers blockdiag's DTensor sharding rules.

The groups of a grouped layer are independent, so they parallelise with no communication:
each rank of a 1-D device mesh owns ``G / world`` consecutive groups (the weight and bias
``Shard(0)``, a DTensor), and a :class:`~blockdiag.GroupedMLP` stack runs rank-local from its
first layer to its last. :class:`GroupParallel` is the ``ParallelStyle`` for
``torch.distributed.tensor.parallel.parallelize_module``; :func:`parallelize_groups` applies it
to a whole model; :func:`gather_model` collects a plain copy; :func:`local_groups` says which
groups (heads) a rank owns. The full guide, with FSDP2 on a 2-D mesh, distributed checkpoints
and a multi-GPU recipe, is ``docs/distributed.md``.

Example (on every rank of a ``torchrun`` job; not run here)::

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import blockdiag, blockdiag.distributed as bdd

    dist.init_process_group("gloo")  # "nccl" on GPUs
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = blockdiag.GroupedMLP(150, [10, 10], 1, heads=52)  # the same seed on every rank
    bdd.parallelize_groups(model, mesh)  # output: this rank's heads, Shard(-1), as a local tensor
    y_local = model(x)                   # x: the whole (replicated) input; no collective
    heads = bdd.local_groups(model.heads, mesh)  # the heads whose outputs y_local holds
"""

from __future__ import annotations

import copy
import inspect
from typing import cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.nn.utils import parametrize

from ._checks import as_size, is_int
from ._errors import BlockDiagError
from .nn import GroupedLinear, GroupedMLP
from .nn.linear import _read_current, _trains
from .ops import _sharding
from .ops._sharding import UnevenGroupsError

__all__ = ["GroupParallel", "UnevenGroupsError", "gather_model", "local_groups", "parallelize_groups"]

_sharding.ensure()

# distribute_tensor's src_data_rank (which rank's values are scattered; None: each rank's own)
# arrived in torch 2.6; older versions always scatter rank 0's.
_HAS_SRC_DATA_RANK = "src_data_rank" in inspect.signature(distribute_tensor).parameters


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_mesh(fn: str, mesh: DeviceMesh) -> int:
    if not isinstance(mesh, DeviceMesh):
        raise BlockDiagError(f"{fn}: device_mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        names = getattr(mesh, "mesh_dim_names", None)
        raise BlockDiagError(
            f"{fn}: group parallelism shards over one mesh dimension, got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}" + (f" with dimensions {names}" if names else "")
            + "; pass one dimension of it, e.g. mesh['gp'] (FSDP2 takes another, see docs/distributed.md)"
        )
    return mesh.size()


def _check_split(fn: str, what: str, count: int, world: int, hint: str) -> None:
    """Each rank must own the same number of whole groups (heads)."""
    if count % world != 0:
        near = sorted({max(world, count - count % world), count - count % world + world})
        raise BlockDiagError(
            f"{fn}: {what}={count} cannot be split evenly over {world} ranks: each rank must own "
            f"the same number of whole {hint} (DTensor shards features with torch.chunk, which would "
            f"cut a group apart); use {what} divisible by {world} (e.g. "
            f"{' or '.join(map(str, near))}) or a mesh dimension whose size divides {count} ({_divisors(count)})"
        )


def _check_plain(fn: str, module: nn.Module) -> None:
    """Group parallelism applies once, to plain parameters (before FSDP2's ``fully_shard``)."""
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            raise BlockDiagError(
                f"{fn}: parameter {name!r} is already a DTensor {tuple(p.placements)}: apply group "
                "parallelism once, to a model with plain parameters, and before FSDP2's fully_shard"
            )


def _placement(fn: str, arg: str, p: Placement | None, default: Placement, ndim_hint: str) -> Placement:
    p = default if p is None else p
    if isinstance(p, (tuple, list)):
        if len(p) != 1:
            raise BlockDiagError(f"{fn}: {arg} must be one placement on a 1-D mesh, got {p!r}")
        p = p[0]
    if isinstance(p, Replicate):
        return p
    if type(p) is Shard and p.dim == -1:
        return p
    raise BlockDiagError(
        f"{fn}: {arg} must be Replicate() or Shard(-1) ({ndim_hint}), got {p!r}"
    )


def _laid_out_as(x, layout: Placement) -> bool:
    """Whether the 1-D-mesh DTensor ``x`` is laid out as ``layout`` (``Replicate()`` or ``Shard(-1)``).

    Compared without building a placement: under ``torch.compile(dynamic=True)`` dynamo may
    trace ``Shard.dim`` as a symbolic int, which a new ``Shard`` cannot take.
    """
    (p,) = x.placements
    if isinstance(layout, Replicate):
        return isinstance(p, Replicate)
    return type(p) is Shard and p.dim % x.ndim == layout.dim % x.ndim


def _check_local_width(fn: str, x, layout: Placement, width: int, world: int, mesh: DeviceMesh) -> None:
    """A plain input said to be sharded by feature must have this rank's share of the features."""
    if (type(layout) is Shard and isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() >= 1
            and x.shape[-1] != width // world):
        if mesh.get_coordinate() is None:
            # DTensor computes nothing on a rank outside the mesh and hands back an empty local
            # tensor, which reaches the next layer here: its width is not the caller's mistake.
            raise BlockDiagError(_outside_mesh(fn, mesh, f"the input here has shape {tuple(x.shape)}"))
        whole = " (the whole input? pass input_layouts=Replicate() for that)" if x.shape[-1] == width else ""
        raise BlockDiagError(
            f"{fn}: with input_layouts=Shard(-1) each rank passes its own groups' features, "
            f"[..., {width} / {world} = {width // world}]; this rank passed shape {tuple(x.shape)}{whole}"
        )


def _outside_mesh(fn: str, mesh: DeviceMesh, what: str) -> str:
    return (f"{fn}: this process (global rank {dist.get_rank()}) is not in {mesh}, so it owns none of the groups "
            f"(DTensor computes nothing on it: a group-parallel layer's output there is an empty tensor); {what}; "
            "run the model on the ranks of its mesh")


def _to_dtensor(fn: str, x, mesh: DeviceMesh, layout: Placement, want: Placement | None = None,
                width: int | None = None):
    """``x`` as a DTensor laid out as ``layout`` says it is, then redistributed to ``want``.

    A DTensor input is taken as it is laid out, replicated, partial or sharded on any dimension
    (unevenly too), and redistributed to ``want``.

    ``want``: the layout the op reads (``Shard(-1)``, by group, for a layer of several
    groups; ``Replicate()`` for one group, split by output rows), taken
    here in the module's hook as torch's ``RowwiseParallel`` takes its own, rather than left
    to the op's sharding rule: there a replicated input's slice was traced with this rank's
    offsets into a compiled graph that torch's compile caches, which do not key on the rank,
    then served to the other ranks (their outputs and the weight gradient silently wrong).
    """
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            # Checked before its placements are read: those of a mesh with more dimensions do
            # not fit this 1-D mesh, and torch cannot redistribute across meshes.
            raise BlockDiagError(
                f"{fn}: the input is a DTensor on {x.device_mesh} with placements {tuple(x.placements)}, but the "
                f"parameters are sharded over {mesh}; pass the input as a DTensor on that mesh, or as a plain "
                "tensor laid out as input_layouts says"
            )
    else:
        kw = {}
        if width is not None and type(layout) is Shard:
            # The global shape from the module's own width, with contiguous strides, rather than
            # inferred from the local tensor's: torch.compile may trace a local slice's width and
            # row stride as symbols (compiled again for another width), and DTensor's sharding
            # cache cannot hash a spec that holds one.
            shape = (*x.shape[:-1], width)
            kw = {"shape": torch.Size(shape), "stride": _sharding.contiguous_strides(shape)}
        x = DTensor.from_local(x, mesh, (layout,), run_check=False, **kw)
    if want is not None and not _laid_out_as(x, want):
        sliced = _laid_out_as(x, Replicate())
        x = x.redistribute(mesh, (want,))
        if not sliced and not x.to_local().is_contiguous():
            # torch's all-to-all from a dimension sharded unevenly leaves a padded local tensor
            # that DTensor's own contiguous() keeps and its reshape then fails to view.
            x = DTensor.from_local(x.to_local().contiguous(), mesh, x.placements, run_check=False,
                                   shape=x.shape, stride=x.stride())
    return x


def _finish(x, layout: Placement, use_local_output: bool):
    if not isinstance(x, DTensor):
        return x
    if not _laid_out_as(x, layout):
        x = x.redistribute(placements=(layout,))
    return x.to_local() if use_local_output else x


class GroupParallel(ParallelStyle):
    """Shard a ``GroupedLinear``'s groups (or a ``GroupedMLP``'s heads) across a 1-D mesh.

    A ``ParallelStyle`` for ``torch.distributed.tensor.parallel.parallelize_module``. On a
    :class:`~blockdiag.GroupedLinear` with ``groups > 1`` it makes the weight
    ``[G, out, in]`` and bias ``[G*out]`` DTensors sharded by group (``Shard(0)``): rank ``r``
    of ``world`` holds groups ``r*G/world ... (r+1)*G/world - 1``. A one-group layer (the wide
    first layer of a shared-input ``GroupedMLP``) is split by output rows instead (weight
    ``Shard(1)``, bias ``Shard(0)``, column parallelism), which gives each rank the hidden units
    of its own heads. On a :class:`~blockdiag.GroupedMLP` it does this to every layer so that
    the whole stack runs rank-local (:func:`parallelize_groups`).

    Args:
        input_layouts: how a plain (local) input tensor is laid out across the mesh:
            ``Replicate()`` (default: every rank passes the whole input; each rank's product
            takes its own groups' slice of it, with no communication) or
            ``Shard(-1)`` (each rank passes only its groups' features, ``[..., G/world * in]``;
            not for a shared input, which every head reads whole). A DTensor input may be
            laid out in any way (rows sharded, unevenly too, or a partial sum): it is
            redistributed to the layer's groups.
        output_layouts: ``Shard(-1)`` (default: each rank keeps its groups' outputs
            ``[..., G/world * out]``, no communication) or ``Replicate()`` (one all-gather:
            every rank gets the whole output).
        use_local_output: return a plain local tensor (default) instead of a DTensor.

    Raises:
        BlockDiagError: a layout other than the above; when applied, another module type, a
            mesh that is not 1-D, a group (head) count the mesh cannot split evenly (the
            message names it and the number of ranks), or ``input_layouts=Shard(-1)`` on a
            one-group layer whose ``in_features`` the mesh cannot split evenly.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        super().__init__()
        fn = type(self).__name__
        self.input_layouts = _placement(fn, "input_layouts", input_layouts, Replicate(), "the input's last dimension, by group")
        self.output_layouts = _placement(fn, "output_layouts", output_layouts, Shard(-1), "the output's last dimension, by group")
        self.use_local_output = bool(use_local_output)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output})"
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        fn = type(self).__name__
        if isinstance(module, GroupedMLP):
            return _parallelize_mlp(fn, module, device_mesh, self)
        if not isinstance(module, GroupedLinear):
            raise BlockDiagError(
                f"{fn}: applies to a blockdiag GroupedLinear or GroupedMLP, got {type(module).__name__}"
            )
        world = _check_mesh(fn, device_mesh)
        _check_plain(fn, module)
        if module.groups > 1:
            _check_split(fn, "groups", module.groups, world, "groups")
        else:
            _check_split(fn, "out_features", module.out_features, world, "output rows of the one group")
            if isinstance(self.input_layouts, Shard) and module.in_features % world:
                # Each rank's share of a sharded input is taken as in_features / world wide
                # (its global width is inferred from it): refused here, on every rank alike,
                # rather than on the ranks whose torch.chunk piece is wider, before a collective.
                raise BlockDiagError(
                    f"{fn}: input_layouts=Shard(-1) on a one-group layer with in_features={module.in_features}, "
                    f"which {world} ranks cannot share evenly; pass the input replicated (input_layouts=Replicate(), "
                    f"the default) or use a mesh dimension whose size divides {module.in_features} "
                    f"({_divisors(module.in_features)})"
                )
        _shard_layer(module, device_mesh, getattr(self, "src_data_rank", 0))
        # The layout the op reads: by group, or for one group (column parallel, as torch's
        # ColwiseParallel) the whole input. Taken here, not left to the op's rule: a DTensor
        # input whose rows are sharded unevenly could not be flattened to the op's 2-D rows.
        by_group = Shard(-1) if module.groups > 1 else Replicate()

        def prepare(x):
            _check_local_width(fn, x, self.input_layouts, module.in_features, world, device_mesh)
            return _to_dtensor(fn, x, device_mesh, self.input_layouts, by_group, module.in_features)

        _on_input(module, prepare)
        return distribute_module(
            module,
            device_mesh,
            None,
            None,
            lambda mod, out, mesh: _finish(out, self.output_layouts, self.use_local_output),
        )


def _on_input(module: nn.Module, prepare) -> None:
    """Run ``prepare`` on the input of every call of ``module``, passed positionally or as ``x=``.

    A forward pre-hook that sees keyword arguments: ``distribute_module``'s own input hook
    is given the positional ones only, so ``model(x=batch)`` would reach the layers unprepared.
    """

    def hook(mod, args, kwargs):
        if args:
            x = prepare(args[0])
            return None if x is args[0] else ((x, *args[1:]), kwargs)
        if "x" in kwargs:
            x = prepare(kwargs["x"])
            return None if x is kwargs["x"] else (args, {**kwargs, "x": x})
        return None  # no input: the forward's own TypeError says so

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _shard_layer(layer: GroupedLinear, mesh: DeviceMesh, src_data_rank) -> None:
    """Weight ``Shard(0)`` by group (``Shard(1)``, by output row, for one group); bias ``Shard(0)``."""
    kw = {"src_data_rank": src_data_rank} if _HAS_SRC_DATA_RANK else {}
    for name, placement in (("weight", Shard(1) if layer.groups == 1 else Shard(0)), ("bias", Shard(0))):
        p = layer._parameters.get(name)
        if p is None:
            continue
        layer.register_parameter(
            name, nn.Parameter(distribute_tensor(p.detach(), mesh, [placement], **kw), requires_grad=p.requires_grad)
        )


def _parallelize_mlp(fn: str, model: GroupedMLP, mesh: DeviceMesh, style: GroupParallel) -> GroupedMLP:
    world = _check_mesh(fn, mesh)
    _check_plain(fn, model)
    _check_split(fn, "heads", model.heads, world, "heads")
    if model.shared_input and isinstance(style.input_layouts, Shard):
        raise BlockDiagError(
            f"{fn}: input_layouts=Shard(-1) on a shared-input GroupedMLP: every head reads the whole input, "
            "so it cannot be sharded by head; pass it replicated (input_layouts=Replicate(), the default)"
        )
    last = len(model.layers) - 1
    for k, layer in enumerate(model.layers):
        sub = GroupParallel(
            input_layouts=style.input_layouts if k == 0 else Shard(-1),
            output_layouts=style.output_layouts if k == last else Shard(-1),
            use_local_output=style.use_local_output if k == last else True,
        )
        sub.src_data_rank = getattr(style, "src_data_rank", 0)
        sub._apply(layer, mesh)
    # The model checks the input's global shape before its first layer runs: make a local
    # input sharded by head a DTensor here already (the first layer then takes it as it is).
    # A replicated one is its own global shape and stays plain until the first layer's hook:
    # a DTensor handed from this hook to the forward crosses a graph break, and inductor then
    # fails to compile the backward of the first layer's Replicate -> Shard(-1) slice under
    # dynamic shapes (its width symbol is not bound in the backward graph).
    width = model.heads * model.in_features

    def prepare(x):
        _check_local_width(fn, x, style.input_layouts, width, world, mesh)
        if isinstance(style.input_layouts, Replicate):
            return x
        return _to_dtensor(fn, x, mesh, style.input_layouts, width=width)

    _on_input(model, prepare)
    return model


# One signature per class (here and for gather_model), so that a type checker keeps the
# class's own methods and sizes on what comes back: parallelize_groups(mlp).heads,
# gather_model(mlp).to_heads(), gather_model(layer).to_linears().
@overload
def parallelize_groups(
    model: GroupedMLP,
    mesh: DeviceMesh,
    *,
    input_layouts: Placement | None = None,
    output_layouts: Placement | None = None,
    use_local_output: bool = True,
) -> GroupedMLP: ...
@overload
def parallelize_groups(
    model: GroupedLinear,
    mesh: DeviceMesh,
    *,
    input_layouts: Placement | None = None,
    output_layouts: Placement | None = None,
    use_local_output: bool = True,
) -> GroupedLinear: ...
def parallelize_groups(
    model: GroupedMLP | GroupedLinear,
    mesh: DeviceMesh,
    *,
    input_layouts: Placement | None = None,
    output_layouts: Placement | None = None,
    use_local_output: bool = True,
) -> GroupedMLP | GroupedLinear:
    """Shard a model's heads (groups) across a 1-D mesh, in place: :class:`GroupParallel` on it.

    On a :class:`~blockdiag.GroupedMLP` every layer is sharded by head, so the stack runs
    rank-local from the first layer to the last: rank ``r`` computes heads
    :func:`local_groups` ``(model.heads, mesh)``. A shared input's first layer (one group,
    ``[1, heads*hidden, in]``) is split by output rows (weight ``Shard(1)``), which are exactly
    the hidden units of this rank's heads; every later layer by group (``Shard(0)``). Between
    layers the hidden units stay local tensors; the only collective is the all-gather of the
    output when ``output_layouts=Replicate()`` (none by default). The gradients need none
    either: each rank's parameters get the gradients of its own heads. Call it on every
    rank, with the same initial parameters (the same seed), before creating the optimizer.

    Args:
        model: a ``GroupedMLP`` or a ``GroupedLinear``.
        mesh: a 1-D ``DeviceMesh`` (one dimension of a larger one, e.g. ``mesh["gp"]``).
        input_layouts: see :class:`GroupParallel`.
        output_layouts: see :class:`GroupParallel`.
        use_local_output: see :class:`GroupParallel`.

    Returns:
        ``model``, its parameters now DTensors.

    Raises:
        BlockDiagError: heads (groups) not divisible by the mesh size, naming both; a mesh
            that is not 1-D; a sharded input for a shared-input model.
    """
    style = GroupParallel(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
    fn = "parallelize_groups"
    if not isinstance(model, (GroupedMLP, GroupedLinear)):
        raise BlockDiagError(f"{fn}: model must be a blockdiag GroupedMLP or GroupedLinear, got {type(model).__name__}")
    _check_mesh(fn, mesh)  # before parallelize_module, whose own refusal of a 2-D mesh names no dimension
    # GroupParallel._apply returns the module it was given (typed nn.Module by torch).
    return cast("GroupedMLP | GroupedLinear", parallelize_module(model, mesh, style))


def local_groups(groups: int, mesh: DeviceMesh) -> range:
    """The groups (heads) this rank owns when ``groups`` are sharded over the 1-D ``mesh``.

    Args:
        groups: the model's group or head count (divisible by the mesh size).
        mesh: the 1-D mesh the model was parallelized over.

    Returns:
        ``range(r * groups // world, (r + 1) * groups // world)`` for this rank's
        coordinate ``r`` on the mesh; a sharded output holds these heads, in order.

    Raises:
        BlockDiagError: ``groups`` not a positive integer (a model instead of its
            ``heads``, zero, a negative or fractional count); otherwise as
            :func:`parallelize_groups`.
    """
    groups = as_size(groups)  # a NumPy integer counts as its int, as GroupedLinear's sizes do
    if not is_int(groups, 1):
        # range() would take a negative or zero count (every rank owning an empty or
        # negative range) and fail on a float or a model with a bare TypeError.
        if isinstance(groups, nn.Module):
            count = "heads" if isinstance(groups, GroupedMLP) else "groups"
            got = f"a {type(groups).__name__} module; pass its count (model.{count}), not the model"
        else:
            got = f"{groups!r} ({type(groups).__name__})"
        raise BlockDiagError(
            f"local_groups: groups must be a positive int (the model's group or head count), got {got}"
        )
    world = _check_mesh("local_groups", mesh)
    _check_split("local_groups", "groups", groups, world, "groups")
    if mesh.get_coordinate() is None:
        # torch's get_local_rank fails there with an IndexError from its own internals.
        raise BlockDiagError(_outside_mesh("local_groups", mesh, "there is no range to give"))
    r = mesh.get_local_rank()
    per = groups // world
    return range(r * per, (r + 1) * per)


@overload
def gather_model(model: GroupedMLP) -> GroupedMLP: ...
@overload
def gather_model(model: GroupedLinear) -> GroupedLinear: ...
def gather_model(model: GroupedMLP | GroupedLinear) -> GroupedMLP | GroupedLinear:
    """A plain (undistributed) copy of a group-parallel model, every parameter gathered in full.

    A collective: call it on every rank (each gets the whole copy). Use it before
    :meth:`~blockdiag.GroupedMLP.to_heads` or ``to_linears``, which refuse a distributed
    model, or to evaluate or save the model on one rank.

    Each layer's weight and bias are read as its next forward computes them, then gathered:
    a weight that a parametrization or a hook computes (``parametrize``, ``prune``,
    ``spectral_norm``) is copied as the weight it computes now, without the parametrization,
    as :meth:`~blockdiag.GroupedMLP.to_heads` copies it.

    Args:
        model: a ``GroupedMLP`` or ``GroupedLinear`` whose parameters may be DTensors (group
            parallel, FSDP2, or both).

    Returns:
        a new ``GroupedMLP`` or ``GroupedLinear`` of the same configuration (each layer's
        backend, training mode and ``requires_grad``) on the parameters' device, with plain
        parameters equal to the full tensors; ``model`` is unchanged. A subclass's own class
        is not rebuilt (its constructor may take other arguments): load the result's
        ``state_dict()`` into an instance of it.

    Raises:
        BlockDiagError: another module type.
    """
    fn = "gather_model"
    if not isinstance(model, (GroupedMLP, GroupedLinear)):
        raise BlockDiagError(f"{fn}: model must be a blockdiag GroupedMLP or GroupedLinear, got {type(model).__name__}")
    # Read from the layers, not model.state_dict(): a parametrized or pruned layer's state dict
    # holds what its weight is computed from (parametrizations.weight.original, weight_orig),
    # keys a plain model does not have. Each parametrization runs once (parametrize.cached()).
    if isinstance(model, GroupedMLP):
        named = [(f"layers.{k}.", layer) for k, layer in enumerate(model.layers)]
    else:
        named = [("", model)]
    state, trains = {}, {}
    with parametrize.cached():
        for prefix, layer in named:
            for name in ("weight", "bias"):
                t = _read_current(layer, name)
                if t is not None:
                    trains[prefix + name] = _trains(layer, name, t)
                    state[prefix + name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
    w = state[named[0][0] + "weight"]
    if isinstance(model, GroupedMLP):
        plain = GroupedMLP(
            model.in_features, list(model.hidden_features), model.out_features, model.heads,
            bias=[layer.bias is not None for layer in model.layers], shared_input=model.shared_input,
            strategy=model.strategy, device=w.device, dtype=w.dtype,
        )
        for mine, theirs in zip(plain.layers, model.layers):  # each its own ("mixed" is no name)
            mine.backend = theirs.backend
        plain.activations = copy.deepcopy(model.activations)
        plain.output_activation = copy.deepcopy(model._modules.get("output_activation"))
        if "_head_names" in model.__dict__:  # from_heads' names, for to_heads on the copy
            plain._head_names = model._head_names
            if "_head_linears" in model.__dict__:
                plain._head_linears = model._head_linears
    else:
        plain = GroupedLinear(
            model.in_features, model.out_features, model.groups, model.bias is not None,
            backend=model.backend, device=w.device, dtype=w.dtype,
        )
    plain.load_state_dict(state)
    for name, p in plain.named_parameters():
        p.requires_grad_(trains[name])
    # eval() kept, module by module, matched by name: a parametrized layer holds modules
    # (its parametrizations) that the plain copy does not.
    theirs = dict(model.named_modules())
    for name, mine in plain.named_modules():
        if name in theirs:
            mine.training = theirs[name].training
    return plain
