"""Masked gradient updates: keep a dense ``nn.Linear`` weight exactly block-diagonal.

:func:`mask_block_diagonal_` registers a ``torch.nn.utils.parametrize`` parametrization
``weight = torch.where(mask, original, 0)``. Whatever any optimizer does to ``original``
(momentum, Adam's moments, decoupled weight decay, clipping), the ``weight`` that forward uses
and that users read is recomputed from it through the mask, so its off-diagonal entries are
exactly ``0.0`` (selected, not multiplied by ``False``: ``inf * 0`` is NaN), and their gradient
w.r.t. ``original`` is exactly zero.
``original`` is also zeroed off the diagonal when the mask is installed.

Checkpoints: ``state_dict()`` stores the masked weight under the plain key ``weight``, so the
checkpoint loads into an unmasked ``nn.Linear`` too. The entry is ``original`` itself (detached),
which is zero off the blocks, so in-place loaders (``torch.distributed.checkpoint.load``) write
the parameter, as they do a plain module's; off-block values that reached ``original`` anyway
(a NaN gradient through ``clip_grad_norm_``, an optimizer state resumed from an unmasked run)
are never read, and ``state_dict()`` zeroes them first. That holds while the mask is the only
parametrization of ``weight``; with others stacked on it (``spectral_norm``, a user's), the
state dict keeps torch's own keys (``parametrizations.weight.original`` and theirs), since the
masked ``original`` alone is not the weight the module computes. ``load_state_dict`` of a checkpoint
whose ``weight`` has non-zeros outside the blocks is **refused** with
:class:`BlockDiagError` naming the first offending entry (masking it silently would hide a
checkpoint that does not belong to this model).

Meta-device initialisation works: build the model under ``torch.device("meta")``, mask it,
``to_empty(device=...)``, then ``reset_parameters()`` or ``load_state_dict``. The mask is
not a buffer (``to_empty`` would leave it uninitialised) but derived from the shape on
demand, and the masked module's ``reset_parameters`` initialises ``original`` (a plain
parametrization would let it initialise a temporary copy of ``weight`` and keep nothing).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._checks import as_size, as_sizes, check, check_groups, is_int
from ._errors import BlockDiagError
from .ops._sharding import is_dtensor

__all__ = ["BlockDiagonalMask", "mask_block_diagonal_", "remove_block_diagonal_mask_"]

_ORIG = "parametrizations.weight.original"
_PLAIN = (torch.Tensor, nn.Parameter)


class BlockDiagonalMask(nn.Module):
    """Parametrization ``W -> torch.where(mask, W, 0)`` for a ``[G*out, G*in]`` weight.

    >>> m = BlockDiagonalMask(2, (1, 2))
    >>> m(torch.ones(2, 4))
    tensor([[1., 1., 0., 0.],
            [0., 0., 1., 1.]])
    """

    def __init__(self, groups: int, block_shape: tuple[int, int]):
        super().__init__()
        fn = "BlockDiagonalMask"
        groups, block_shape = as_size(groups), as_sizes(block_shape)
        check(fn, is_int(groups, 1), f"groups must be an int >= 1, got {groups!r}")
        shape = tuple(block_shape) if isinstance(block_shape, (tuple, list, torch.Size)) else None
        check(fn, shape is not None and len(shape) == 2
              and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape),
              f"block_shape must be two ints >= 1 (rows, columns), got {block_shape!r}")
        self.groups = groups
        self.block_shape = shape
        # The mask is a pure function of (groups, block_shape, device), so it is derived on
        # demand and cached per device, never stored as a buffer: a buffer is state that
        # module-wide operations rewrite without knowing what it means. ``to_empty()`` (the
        # meta-device init flow) left it uninitialised (issue 22, item 7: off-diagonal
        # weights of ~2.5, genuine checkpoints refused), and so would any tool that
        # re-creates buffers (FSDP-style materialisation, ``load_state_dict(assign=True)``
        # of a full model). Re-validating a buffer's content on each use would cost as much
        # as building it; a device-keyed cache costs one dict lookup. A plain dict
        # attribute: not in ``state_dict``, copied by ``deepcopy``, untouched by ``_apply``.
        self._masks: dict[torch.device, torch.Tensor] = {}
        # True only inside the masked module's ``reset_parameters``: ``weight`` is then
        # ``original`` itself, so in-place initialisers write into the parameter.
        self._passthrough = False

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The ``[G*out, G*in]`` shape of the weight this mask applies to."""
        r, c = self.block_shape
        return self.groups * r, self.groups * c

    def mask_on(self, device: torch.device | str) -> torch.Tensor:
        """The bool ``[G*out, G*in]`` mask (True inside the blocks) on ``device``: a new tensor,
        which the caller may change without touching the mask in use."""
        return self._mask_on(device).clone()

    def _mask_on(self, device: torch.device | str) -> torch.Tensor:
        """The cached mask itself (never handed out: writing into it would unmask the weight)."""
        device = torch.device(device)
        m = self._masks.get(device)
        if m is None:
            m = _build_mask(self.groups, self.block_shape, device)
            if _cacheable(m):
                if len(self._masks) >= 8:  # devices come and go (meta, cpu, cuda:k): stay small
                    self._masks.clear()
                self._masks[device] = m
        return m

    @property
    def mask(self) -> torch.Tensor:
        """The mask on the CPU (see :meth:`mask_on` for another device)."""
        return self.mask_on("cpu")

    def _check(self, w: torch.Tensor) -> None:
        if tuple(w.shape) != self.weight_shape:
            raise BlockDiagError(
                f"BlockDiagonalMask: weight of shape {tuple(w.shape)} does not fit {self.groups} blocks of shape "
                f"{self.block_shape}, which make a weight of shape {self.weight_shape}"
            )

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self._passthrough:
            return w
        self._check(w)
        # Selecting, not multiplying: NaN * 0 and inf * 0 are NaN, so one non-finite gradient
        # entry would turn `original`'s off-diagonal entries NaN for good. ``where``'s
        # backward passes exact zeros there instead.
        return torch.where(self._mask_on(w.device) if type(w) in _PLAIN else _mask_like(self, w), w, 0)

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        # Assigning linear.weight = W stores W masked, so `original` never holds stray values.
        self._check(w)
        return torch.where(self._mask_on(w.device), w, 0)

    def extra_repr(self) -> str:
        return f"groups={self.groups}, block_shape={self.block_shape}"


def _build_mask(groups: int, block_shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    def build():
        r, c = block_shape
        eye = torch.eye(groups, dtype=torch.bool, device=device)
        return eye[:, None, :, None].expand(groups, r, groups, c).reshape(groups * r, groups * c)

    if torch.compiler.is_compiling():
        return build()  # traced into the graph, never cached
    # Outside inference mode, so the cached mask can be saved for a later backward.
    with torch.inference_mode(False):
        return build()


def _cacheable(m: torch.Tensor) -> bool:
    # Only a real tensor outlives the call: under FakeTensorMode (export, compile's tracing)
    # factories return FakeTensors, under torch.func.grad functorch-wrapped tensors.
    if type(m) is not torch.Tensor or torch.compiler.is_compiling():
        return False
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return not (wrapped is not None and wrapped(m))


def _mask_of(module: nn.Module) -> BlockDiagonalMask | None:
    """The module's block-diagonal mask, the first parametrization of ``weight``, or None."""
    if not parametrize.is_parametrized(module, "weight"):
        return None
    first = module.parametrizations.weight[0]
    return first if isinstance(first, BlockDiagonalMask) else None


def _only_mask(module: nn.Module) -> bool:
    """Whether the mask is the only parametrization of ``weight`` (checkpoints use plain keys)."""
    return _mask_of(module) is not None and len(module.parametrizations.weight) == 1


@contextlib.contextmanager
def _weight_is_original(module: nn.Module):
    """Within it ``module.weight`` is ``original`` itself: the mask passes it through and the
    parametrizations stacked on the mask are set aside, so an in-place initialiser of
    ``weight`` writes into the parameter."""
    plist = module.parametrizations.weight
    mask_mod, stacked = plist[0], plist._modules
    plist._modules = type(stacked)([("0", mask_mod)])
    mask_mod._passthrough = True
    try:
        yield
    finally:
        mask_mod._passthrough = False
        plist._modules = stacked


def _reset_parameters(self) -> None:
    """``reset_parameters`` of a masked module: initialise ``original``, then mask it.

    The module's own ``reset_parameters`` (``nn.Linear``'s: ``kaiming_uniform_(self.weight)``)
    would initialise the tensor a parametrized ``weight`` computes, a temporary, and keep
    nothing: after ``to_empty()`` the diagonal blocks would hold uninitialised memory. The
    parametrizations stacked on the mask are set aside meanwhile: ``original`` gets the
    module's own initialisation, which they then transform as they do any value.
    """
    base = _overridden(self, "reset_parameters", _reset_parameters)
    mask_mod = _mask_of(self)
    if mask_mod is None:
        return base()
    with _weight_is_original(self):
        base()
    with torch.no_grad():
        orig = self.parametrizations.weight.original
        orig.masked_fill_(~_mask_like(mask_mod, orig), 0)


def _overridden(module: nn.Module, name: str, replacement):
    """The method ``name`` that the masked module's ``replacement`` replaces, bound to ``module``.

    Looked up past the class that holds the replacement, not past ``type(module)``: a class
    derived from the masked module's own (FSDP2's ``fully_shard`` gives the module one)
    inherits the replacement, which ``super(type(module), module)`` would find again,
    recursing without end.
    """
    for cls in type(module).__mro__:
        if cls.__dict__.get(name) is replacement:
            return getattr(super(cls, module), name)
    return getattr(super(type(module), module), name)


def _state_dict(self, *args, **kwargs):
    """``state_dict`` of a masked module: the mask's state-dict hook runs before the others.

    It puts the masked weight under the plain key ``weight``; a hook registered before
    masking (one that casts or renames the module's ``weight`` entry, as on a plain
    ``nn.Linear``) ran first and found the internal key instead, and the entry it was to change
    was saved as it was, silently. The hooks run after the submodules are saved, where
    ``original`` is, so the order of the hooks is what decides.
    """
    hooks = self.__dict__.get("_blockdiag_hooks")
    if hooks is not None and hooks[0].id in self._state_dict_hooks:
        self._state_dict_hooks.move_to_end(hooks[0].id, last=False)
    return _overridden(self, "state_dict", _state_dict)(*args, **kwargs)


def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
    """``_load_from_state_dict`` of a masked module: the mask's load pre-hook runs after the others.

    torch runs a module's load pre-hooks in the order they were registered, and the mask's
    moves the checkpoint's ``weight`` to the parametrization's key: a hook registered after
    masking that puts ``weight`` into the state dict (renaming an old checkpoint's key, as it
    does on a plain ``nn.Linear``) ran after it, and the load called ``weight`` both missing
    and unexpected (with ``strict=False`` it kept the old weight, silently).
    """
    hooks = self.__dict__.get("_blockdiag_hooks")
    if hooks is not None and hooks[1].id in self._load_state_dict_pre_hooks:
        self._load_state_dict_pre_hooks.move_to_end(hooks[1].id)
    return _overridden(self, "_load_from_state_dict", _load_from_state_dict)(state_dict, prefix, *args, **kwargs)


def _mask_like(mask_mod: BlockDiagonalMask, t: torch.Tensor) -> torch.Tensor:
    """The mask laid out as ``t``: sharded as a DTensor ``t`` is (FSDP2 shards ``original``),
    each rank cutting its own shard from its own copy, without communication."""
    m = mask_mod._mask_on(t.device)
    if is_dtensor(t):
        import inspect

        from torch.distributed.tensor import distribute_tensor

        local = {"src_data_rank": None} if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}
        m = distribute_tensor(m, t.device_mesh, t.placements, **local)
    return m


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    key = prefix + _ORIG
    # torch.onnx's TorchScript exporter traces with the state dict's tensors as the graph's
    # inputs: a derived weight there would leave ``original`` out (a constant that requires
    # grad, which tracing refuses), so while it exports the keys stay torch's.
    onnx = sys.modules.get("torch.onnx")
    if key in state_dict and _only_mask(module) and not (onnx is not None and onnx.is_in_onnx_export()):
        # Detached: with keep_vars=True too, a value (a leaf), as a parameter would be.
        orig = state_dict.pop(key).detach()
        # The plain key holds the masked weight, interchangeable with an unmasked nn.Linear.
        mask = _mask_like(module.parametrizations.weight[0], orig)
        # ``original`` is normally zero off the blocks already (installing the mask, assigning,
        # loading and reset_parameters zero it, and its gradient there is exactly zero), so it
        # is the masked weight itself: the entry is then ``original``, sharing its storage as
        # a plain module's entries share their parameters'. In-place loaders
        # (``torch.distributed.checkpoint.load`` into ``state_dict()``, the pattern of its
        # guide) write into what the state dict holds; a masked copy would take their values
        # and drop them, leaving the weight as it was. Off-block values that reached
        # ``original`` anyway are cleared first (see _clear_off_blocks); a copy is made only
        # where they cannot be.
        param = module.parametrizations.weight._parameters.get("original")
        aliasable = _zero_off_blocks(orig, mask) or _clear_off_blocks(param, orig, mask)
        state_dict[prefix + "weight"] = orig if aliasable else torch.where(mask, orig, 0)
    return state_dict


def _clear_off_blocks(param, orig: torch.Tensor, mask: torch.Tensor) -> bool:
    """Zero ``original`` outside ``mask`` in place if it is the module's own parameter (True if done).

    Off-block values reach ``original`` without anyone writing it directly: a NaN gradient
    makes ``clip_grad_norm_``'s factor NaN, which turns the exact zero gradients off the
    blocks NaN, and the step writes them (and an optimizer's momentum keeps them coming);
    an optimizer state resumed from an unmasked run steps them too. Forward never reads
    them (the mask selects 0 there) and their gradient is zero, so clearing them changes
    nothing the module computes, and the state dict's entry can stay the parameter's
    storage: a masked copy would silently drop what an in-place loader writes into it (a
    rollback with ``torch.distributed.checkpoint.load`` after a NaN step restored nothing).
    A tensor ``functional_call`` put in its place belongs to the caller, and tracer and
    inference tensors cannot be written: those get the masked copy.
    """
    if not isinstance(param, nn.Parameter) or torch.compiler.is_compiling():
        return False
    local, local_mask = (orig.to_local(), mask.to_local()) if is_dtensor(orig) else (orig, mask)
    if type(local) not in _PLAIN or (local.is_inference() and not torch.is_inference_mode_enabled()):
        return False
    with torch.no_grad():
        local.masked_fill_(~local_mask, 0)
    return True


def _zero_off_blocks(orig: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``orig`` has only zeros outside ``mask`` (a DTensor: this rank's shard, no
    communication; meta tensors hold no values, so they alias as they are)."""
    if orig.is_meta:
        return True
    if is_dtensor(orig):
        orig, mask = orig.to_local(), mask.to_local()
    if type(orig) not in _PLAIN or torch.compiler.is_compiling():
        return False  # a value-less tracer tensor: the masked copy needs no data-dependent branch
    # NaN != 0, so a non-finite entry off the blocks takes the masked copy as well.
    return not bool(((orig != 0) & ~mask).any())


def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    module._blockdiag_load_prefix = prefix  # for _load_post_hook, which is given none
    module._blockdiag_load_errors = (errors, len(errors))  # nor the errors, which it renames
    key = prefix + "weight"
    if key not in state_dict or not _only_mask(module):
        return
    w = state_dict[key]
    mask_mod = module.parametrizations.weight[0]
    r, c = mask_mod.block_shape
    shape = mask_mod.weight_shape
    if isinstance(w, torch.Tensor) and w.layout != torch.strided:
        # A block-diagonal weight is naturally saved sparse, but the block check below has no
        # sparse kernel (``!=`` failed inside torch, naming no key), and assigned, a sparse
        # ``original`` would fail every forward.
        errors.append(f'While copying the parameter named "{key}", expected a dense (strided) tensor from '
                      f"checkpoint but received a {w.layout} tensor: convert the entry with .to_dense()")
        state_dict.pop(key)
        module._blockdiag_reported = True
        return
    if isinstance(w, torch.Tensor) and tuple(w.shape) != shape:
        # Reported here under the key the checkpoint has (torch would name the internal one).
        errors.append(f"size mismatch for {key}: copying a param with shape {w.shape} from checkpoint, "
                      f"the shape in current model is {torch.Size(shape)}.")
        state_dict.pop(key)
        module._blockdiag_reported = True
        return
    if isinstance(w, torch.Tensor) and w.device.type != "meta":
        if is_dtensor(w):  # a sharded checkpoint (FSDP2): every rank loads, so every rank gathers
            w = w.full_tensor()
        off = (w != 0) & ~mask_mod._mask_on(w.device)
        if bool(off.any()):
            i, j = (int(v) for v in off.nonzero()[0])
            for name in ("_blockdiag_load_prefix", "_blockdiag_load_errors"):  # no post-hook follows
                module.__dict__.pop(name, None)
            raise BlockDiagError(
                f"load_state_dict: {key} of shape {tuple(w.shape)} has a non-zero "
                f"{w[i, j].item()!r} at ({i}, {j}), outside the {mask_mod.groups} diagonal "
                f"blocks of shape ({r}, {c}); zero it first (e.g. weight * "
                "blockdiag.block_diag_mask(...)) if that is intended"
            )
    state_dict[prefix + _ORIG] = state_dict.pop(key)


def _load_post_hook(module, incompatible):
    """Name ``weight`` in the missing keys and torch's copy errors as ``state_dict()`` does, not
    the internal key (the checkpoint's entry for ``original`` is its ``weight``)."""
    prefix = module.__dict__.pop("_blockdiag_load_prefix", None)
    reported = module.__dict__.pop("_blockdiag_reported", False)
    errors, start = module.__dict__.pop("_blockdiag_load_errors", (None, 0))
    if prefix is None or not _only_mask(module):
        return
    internal = prefix + _ORIG
    if errors is not None:  # those torch added while loading ``original`` (a meta or non-tensor entry)
        for i in range(start, len(errors)):
            errors[i] = errors[i].replace(f'named "{internal}"', f'named "{prefix}weight"')
    if internal in incompatible.missing_keys:
        incompatible.missing_keys.remove(internal)
        if not reported:  # a size mismatch is already an error of its own
            incompatible.missing_keys.append(prefix + "weight")


def mask_block_diagonal_(linear: nn.Linear, groups: int) -> nn.Linear:
    """Make ``linear.weight`` block-diagonal with ``groups`` blocks, and keep it so.

    Zeroes the off-diagonal entries now; afterwards they stay exactly ``0.0`` under any
    optimizer, and loading a checkpoint with off-diagonal non-zeros raises.

    >>> lin = mask_block_diagonal_(nn.Linear(4, 6), groups=2)
    >>> bool((lin.weight[:3, 2:] == 0).all())
    True

    Args:
        linear: an ``nn.Linear`` (or any module with a 2-D ``weight`` parameter).
        groups: number of diagonal blocks; must divide both weight dimensions.

    Returns:
        ``linear`` itself, modified in place.

    Raises:
        BlockDiagError: groups do not divide the weight's shape, the weight is not 2-D,
            or the module is already masked.
    """
    fn = "mask_block_diagonal_"
    groups = as_size(groups)
    w = getattr(linear, "weight", None)
    check(fn, isinstance(w, torch.Tensor), f"linear has no weight tensor (got {type(linear).__name__})")
    check(fn, not isinstance(w, nn.parameter.UninitializedParameter),
          f"linear.weight is not initialised yet ({type(linear).__name__} is lazy): run one forward first")
    check(fn, w.dim() == 2, f"linear.weight must be 2-D, got shape {tuple(w.shape)}")
    if parametrize.is_parametrized(linear, "weight"):
        present = [type(p).__name__ for p in linear.parametrizations.weight]
        check(fn, _mask_of(linear) is None, "linear is already masked")
        plist = linear.parametrizations.weight
        # torch appends a parametrization to a parametrized tensor without calling its
        # right_inverse, which sets up a parametrization of several tensors (the new
        # weight_norm's original0 and original1) and orthogonal's trivialization (its ``base``):
        # stacked on the mask those register, then every forward fails inside torch (a
        # TypeError). Telling the user to stack them would send them there.
        first_only = not hasattr(plist, "original") or any(
            type(p).__name__ == "_Orthogonal" and "base" in p._buffers for p in plist)
        check(fn, not first_only,
              f"linear.weight is already parametrized ({', '.join(present)}), by one that torch runs only as "
              "the first parametrization of a tensor (one of several tensors, as the new weight_norm's, or "
              "orthogonal's with use_trivialization=True): stacked on the mask it would fail at every forward; "
              "use a blockdiag.GroupedLinear with a parametrization of its blocks (see the FAQ), or "
              "orthogonal(..., use_trivialization=False) on top of the mask")
        check(fn, False, f"linear.weight is already parametrized ({', '.join(present)}): mask it first, then "
                         "register the others on top of the mask")
    # A parametrization replaces a parameter or buffer. A weight that is neither is a plain
    # attribute that a forward pre-hook recomputes from other tensors (torch.nn.utils.prune,
    # the old weight_norm and spectral_norm): torch's refusal says the module has no 'weight'
    # at all, which the user can see is there.
    if linear._parameters.get("weight") is None and linear._buffers.get("weight") is None:
        held = [n for n, _ in (*linear.named_parameters(recurse=False), *linear.named_buffers(recurse=False))]
        check(fn, False, f"linear.weight is neither a parameter nor a buffer of the {type(linear).__name__} "
                         f"(it holds {', '.join(held) or 'none'}): a hook recomputes it from others, as "
                         "torch.nn.utils.prune and the old torch.nn.utils.weight_norm / spectral_norm do; "
                         "remove that first (prune.remove, remove_weight_norm, remove_spectral_norm), then mask; "
                         "a parametrization registered on top of the mask takes its place")
    out_f, in_f = w.shape
    check_groups(fn, groups, in_f, out_f)
    mask = BlockDiagonalMask(groups, (out_f // groups, in_f // groups))
    parametrize.register_parametrization(linear, "weight", mask)
    if callable(getattr(linear, "reset_parameters", None)):
        # On the class parametrize made for this one module (copies share it, removing the
        # last parametrization restores the original class).
        type(linear).reset_parameters = _reset_parameters
    cls = type(linear)
    if cls.__dict__.get("__deepcopy__") is not _deepcopy_uncompiled:
        cls._blockdiag_deepcopy = cls.__deepcopy__
        cls.__deepcopy__ = _deepcopy_uncompiled
    cls.state_dict = _state_dict
    cls._load_from_state_dict = _load_from_state_dict
    linear._blockdiag_hooks = (
        linear._register_state_dict_hook(_state_dict_hook),
        linear._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True),
        linear.register_load_state_dict_post_hook(_load_post_hook),
    )
    return linear


def _deepcopy_uncompiled(self, memo):
    """``copy.deepcopy`` of a masked module, without ``module.compile()``'s wrapper.

    torch's parametrized class copies ``__dict__`` whole, ``_compiled_call_impl`` included (the
    plain ``nn.Module.__getstate__`` drops it): that wrapper calls the original's
    ``_call_impl``, so a copy (``AveragedModel``'s too) of a compiled masked module ran the
    original's weights. The copy is not compiled, as a plain module's copy is not.
    """
    replica = type(self)._blockdiag_deepcopy(self, memo)
    replica.__dict__.pop("_compiled_call_impl", None)
    return replica


def _own_class(module: nn.Module) -> None:
    """Give ``module`` a parametrized class of its own before a removal edits it.

    ``copy.deepcopy`` (and ``AveragedModel``) give the copy the original's class, and torch's
    ``remove_parametrizations`` deletes the ``weight`` property from the class: removing the
    mask from one copy would take ``weight`` away from the other.
    """
    cls = type(module)
    body = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    module.__class__ = type(cls.__name__, cls.__bases__, body)


def remove_block_diagonal_mask_(linear: nn.Linear) -> nn.Linear:
    """Undo :func:`mask_block_diagonal_`: ``weight`` is no longer masked.

    The current (block-diagonal) values are kept; from now on they may drift. Only the mask
    goes: with no other parametrization, ``weight`` becomes a plain parameter again; those
    stacked on the mask stay, applied to the (masked) ``original``, so ``weight`` is unchanged.
    Copies of the module (``copy.deepcopy``) keep their masks.

    >>> lin = remove_block_diagonal_mask_(mask_block_diagonal_(nn.Linear(4, 4), 2))
    >>> type(lin.weight).__name__
    'Parameter'

    Args:
        linear: a module masked by :func:`mask_block_diagonal_`.

    Returns:
        ``linear`` itself.

    Raises:
        BlockDiagError: if ``linear`` is not masked, or its class was derived from the masked one
            after masking (``fully_shard``), through which the mask cannot be removed.
    """
    hooks = getattr(linear, "_blockdiag_hooks", None)
    mask_mod = _mask_of(linear)
    if hooks is None or mask_mod is None:
        raise BlockDiagError(
            f"remove_block_diagonal_mask_: {type(linear).__name__} has no block-diagonal mask"
        )
    plist = linear.parametrizations.weight
    if len(plist) == 1 and "weight" not in type(linear).__dict__:
        # torch's remove_parametrizations deletes the ``weight`` property from the module's
        # own class; a class derived after masking (``fully_shard`` derives
        # ``FSDPParametrizedLinear``, whose parameters FSDP has registered) has none to
        # delete, and torch fails half-way with an AttributeError.
        derived = next((c.__name__ for c in type(linear).__mro__[1:] if "weight" in c.__dict__), "?")
        raise BlockDiagError(
            f"remove_block_diagonal_mask_: {type(linear).__name__} is a class derived from the masked "
            f"{derived} after masking (fully_shard and other wrappers do this), so the mask cannot be "
            "removed in place; remove it before wrapping, or copy the (full) weight into a new nn.Linear"
        )
    _own_class(linear)
    if len(plist) == 1:
        parametrize.remove_parametrizations(linear, "weight", leave_parametrized=True)
    else:
        with torch.no_grad():  # weight = rest(mask(original)) = rest(original) once original is masked
            plist.original.masked_fill_(~mask_mod._mask_on(plist.original.device), 0)
        del plist[0]
    # The mask's overrides go; another parametrization keeps the class.
    for name, fn in (("reset_parameters", _reset_parameters), ("state_dict", _state_dict),
                     ("_load_from_state_dict", _load_from_state_dict)):
        if type(linear).__dict__.get(name) is fn:
            delattr(type(linear), name)
    for h in hooks:
        h.remove()
    del linear._blockdiag_hooks
    return linear
