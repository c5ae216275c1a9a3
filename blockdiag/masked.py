"""Masked gradient updates: keep a dense ``nn.Linear`` weight exactly block-diagonal.

:func:`mask_block_diagonal_` registers a ``torch.nn.utils.parametrize`` parametrization
``weight = original * mask``. Whatever any optimizer does to ``original`` (momentum, Adam's
moments, decoupled weight decay, clipping), the ``weight`` that forward uses and that users
read is recomputed from it through the mask, so its off-diagonal entries are exactly
``0.0`` (a product with ``False``), and their gradient w.r.t. ``original`` is exactly zero.
``original`` is also zeroed off the diagonal when the mask is installed.

Checkpoints: ``state_dict()`` stores the masked weight under the plain key ``weight``, so the
checkpoint loads into an unmasked ``nn.Linear`` too. ``load_state_dict`` of a checkpoint
whose ``weight`` has non-zeros outside the blocks is **refused** with
:class:`BlockDiagError` naming the first offending entry (masking it silently would hide a
checkpoint that does not belong to this model).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._checks import check, check_groups
from ._errors import BlockDiagError
from .layout import BlockLayout

__all__ = ["BlockDiagonalMask", "mask_block_diagonal_", "remove_block_diagonal_mask_"]

_ORIG = "parametrizations.weight.original"


class BlockDiagonalMask(nn.Module):
    """Parametrization ``W -> W * mask`` for a ``[G*out, G*in]`` weight.

    >>> m = BlockDiagonalMask(2, (1, 2))
    >>> m(torch.ones(2, 4))
    tensor([[1., 1., 0., 0.],
            [0., 0., 1., 1.]])
    """

    def __init__(self, groups: int, block_shape: tuple[int, int]):
        super().__init__()
        self.groups = groups
        self.block_shape = tuple(block_shape)
        # A buffer (not persistent: it is derived from groups) follows .to(device) moves.
        self.register_buffer("mask", BlockLayout(groups, *block_shape).mask(torch.device("cpu")).clone(), persistent=False)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        # Selecting, not multiplying: NaN * 0 and inf * 0 are NaN, so one non-finite gradient
        # entry would turn `original`'s off-diagonal entries NaN for good. ``where``'s
        # backward passes exact zeros there instead.
        return torch.where(self.mask, w, 0)

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        # Assigning linear.weight = W stores W masked, so `original` never holds stray values.
        return torch.where(self.mask, w, 0)

    def extra_repr(self) -> str:
        return f"groups={self.groups}, block_shape={self.block_shape}"


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    key = prefix + _ORIG
    if key in state_dict:
        orig = state_dict.pop(key)
        # The plain key holds the masked weight, interchangeable with an unmasked nn.Linear.
        state_dict[prefix + "weight"] = torch.where(module.parametrizations.weight[0].mask, orig, 0)
    return state_dict


def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    key = prefix + "weight"
    if key not in state_dict:
        return
    w = state_dict[key]
    mask_mod = module.parametrizations.weight[0]
    if isinstance(w, torch.Tensor) and w.shape == mask_mod.mask.shape:
        off = (w != 0) & ~mask_mod.mask.to(w.device)
        if bool(off.any()):
            i, j = (int(v) for v in off.nonzero()[0])
            r, c = mask_mod.block_shape
            raise BlockDiagError(
                f"load_state_dict: {key} of shape {tuple(w.shape)} has a non-zero "
                f"{w[i, j].item()!r} at ({i}, {j}), outside the {mask_mod.groups} diagonal "
                f"blocks of shape ({r}, {c}); zero it first (e.g. weight * "
                "blockdiag.block_diag_mask(...)) if that is intended"
            )
    state_dict[prefix + _ORIG] = state_dict.pop(key)


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
    w = getattr(linear, "weight", None)
    check(fn, isinstance(w, torch.Tensor), f"linear has no weight tensor (got {type(linear).__name__})")
    check(fn, w.dim() == 2, f"linear.weight must be 2-D, got shape {tuple(w.shape)}")
    check(fn, not parametrize.is_parametrized(linear, "weight"), "linear.weight is already parametrized (masked?)")
    out_f, in_f = w.shape
    check_groups(fn, groups, in_f, out_f)
    mask = BlockDiagonalMask(groups, (out_f // groups, in_f // groups)).to(w.device)
    parametrize.register_parametrization(linear, "weight", mask)
    linear._blockdiag_hooks = (
        linear._register_state_dict_hook(_state_dict_hook),
        linear._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True),
    )
    return linear


def remove_block_diagonal_mask_(linear: nn.Linear) -> nn.Linear:
    """Undo :func:`mask_block_diagonal_`: ``weight`` becomes a plain parameter again.

    The current (block-diagonal) values are kept; from now on they may drift.

    >>> lin = remove_block_diagonal_mask_(mask_block_diagonal_(nn.Linear(4, 4), 2))
    >>> type(lin.weight).__name__
    'Parameter'

    Args:
        linear: a module masked by :func:`mask_block_diagonal_`.

    Returns:
        ``linear`` itself.

    Raises:
        BlockDiagError: if ``linear`` is not masked.
    """
    hooks = getattr(linear, "_blockdiag_hooks", None)
    if hooks is None or not parametrize.is_parametrized(linear, "weight"):
        raise BlockDiagError(
            f"remove_block_diagonal_mask_: {type(linear).__name__} has no block-diagonal mask"
        )
    parametrize.remove_parametrizations(linear, "weight", leave_parametrized=True)
    for h in hooks:
        h.remove()
    del linear._blockdiag_hooks
    return linear
