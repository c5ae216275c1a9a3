"""``check_*`` helpers: each raises :class:`BlockDiagError` with the actual shapes."""

from __future__ import annotations

import operator
from typing import Sequence

import torch

from ._errors import BlockDiagError


def check(fn_name: str, cond: bool, msg: str) -> None:
    """Raise ``BlockDiagError(f"{fn_name}: {msg}")`` unless ``cond``."""
    if not cond:
        raise BlockDiagError(f"{fn_name}: {msg}")


def is_int(value: object, minimum: int | None = None) -> bool:
    """Whether ``value`` is an int (a bool is not a size or a count), at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def as_size(value: object) -> object:
    """``value`` as a plain ``int`` where it is an integer of another type, else ``value`` itself.

    Sizes and counts take what ``operator.index`` takes, as ``nn.Linear``'s do: a NumPy
    integer from a config or a computation (``np.int64(600)``), an ``IntEnum``. They are
    stored as plain ints, so that a module's attributes, repr and compiled guards are those
    of an int. A bool (not a size) and a tensor (a traced or symbolic value) come back as
    they are, for the caller's check to refuse, as does anything ``operator.index`` refuses
    (``4.0``: rounding a size is not ours to guess).

    >>> import numpy as np
    >>> as_size(np.int64(4)), as_size(True), as_size(4.0)
    (4, True, 4.0)
    """
    if type(value) is int or isinstance(value, (bool, torch.Tensor)) or not hasattr(type(value), "__index__"):
        return value
    try:
        return operator.index(value)
    except TypeError:  # numpy's bool has __index__, which refuses
        return value


def as_sizes(value: object) -> object:
    """A tuple, list or ``torch.Size`` of sizes as a tuple of :func:`as_size` each; else ``value``.

    >>> import numpy as np
    >>> as_sizes([np.int64(2), 3]), as_sizes(None)
    ((2, 3), None)
    """
    if isinstance(value, (tuple, list, torch.Size)):
        return tuple(as_size(k) for k in value)
    return value


def check_groups(fn_name: str, groups: object, in_features: int, out_features: int) -> int:
    """Check that ``groups`` is a positive int dividing both feature counts."""
    check(
        fn_name,
        is_int(groups, 1),
        f"groups must be a positive int, got {groups!r}",
    )
    check(
        fn_name,
        is_int(in_features, 1) and is_int(out_features, 1),
        f"in_features and out_features must be positive ints, got in_features={in_features!r}, "
        f"out_features={out_features!r}",
    )
    check(
        fn_name,
        in_features % groups == 0 and out_features % groups == 0,
        f"groups={groups} must divide in_features={in_features} and out_features={out_features}",
    )
    return groups


def check_operand_kinds(fn_name: str, **tensors: object) -> None:
    """Check that each operand is a plain strided tensor (``None`` allowed only for ``bias``).

    Sparse and nested tensors would otherwise reach torch's own layout errors deep inside a
    backend ("Sparse CSR tensors do not have strides", "NestedTensorImpl doesn't support
    sizes"): the message here names the argument, its layout and the conversion to make.
    """
    for arg, t in tensors.items():
        if t is None and arg == "bias":
            continue
        check(fn_name, isinstance(t, torch.Tensor), f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        check(
            fn_name,
            not t.is_nested,
            f"{arg} is a nested tensor; blockdiag's products take a strided [..., features] tensor: "
            f"pad it ({arg}.to_padded_tensor(0.0)) or concatenate its rows (torch.cat({arg}.unbind()))",
        )
        layout = str(t.layout).replace("torch.", "")
        hint = (" (for a sparse weight, keep the dense [groups, block_out, block_in] blocks and choose "
                "backend='csr' or 'bsr')") if arg == "weight" else ""
        check(
            fn_name,
            t.layout == torch.strided,
            f"{arg} is a {layout} tensor; blockdiag's products take strided (dense) tensors: "
            f"pass {arg}.to_dense(){hint}",
        )


def check_float(fn_name: str, arg: str, t: torch.Tensor) -> None:
    """Check that ``t`` has a floating-point dtype."""
    check(fn_name, t.is_floating_point(), f"{arg} must have a floating dtype, got {t.dtype}")


def check_not_erased(fn_name: str, **tensors: object) -> None:
    """Refuse an operand that ``torch.compile``'s freezing discarded, naming it and the setting.

    With ``torch._inductor.config.freezing_discard_parameters`` the compiled graph keeps its
    own copy of each parameter and swaps the module's for an ``ErasedTensor`` on the meta
    device: torch's own ops then say the module ran after freezing, but blockdiag's checks
    come first and would blame a device mismatch (or a DTensor) and ask to move the tensors.
    Called only on a path that is about to refuse, so a call that runs pays nothing.
    """
    for k, t in tensors.items():
        cls = type(t)
        if cls.__name__ == "ErasedTensor" and cls.__module__ == "torch._inductor.freezing":
            raise BlockDiagError(
                f"{fn_name}: {k} was discarded by torch.compile's freezing "
                "(torch._inductor.config.freezing_discard_parameters=True): after freezing the module "
                "runs only as the graphs already compiled, and an eager call or a recompile (another "
                "input shape, a changed setting) needs its parameters; set freezing_discard_parameters=False "
                "to keep them"
            )


def check_same_device_dtype(fn_name: str, **tensors: torch.Tensor | None) -> None:
    """Check that all given tensors share one device and one dtype."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    k0, t0 = items[0]
    for k, t in items[1:]:
        same_device = t.device == t0.device  # once: this runs on every forward and backward
        if not same_device:
            check_not_erased(fn_name, **dict(items))
        check(
            fn_name,
            same_device,
            f"{k} is on {t.device} but {k0} is on {t0.device}; move them to one device",
        )
        check(
            fn_name,
            t.dtype == t0.dtype,
            f"{k} has dtype {t.dtype} but {k0} has dtype {t0.dtype}; cast them to one dtype",
        )


def _check_strided_block(fn_name: str, arg: str, t: torch.Tensor) -> None:
    # The builders index, stack and reshape the blocks as strided tensors: sparse or nested
    # blocks passed the shape checks and failed inside torch ("unsupported memory format
    # option Contiguous", "NestedTensorImpl doesn't support sizes"), naming no argument.
    check(
        fn_name,
        not t.is_nested,
        f"{arg} is a nested tensor; the builders take strided (dense) blocks of one shape: "
        f"pass torch.stack({arg}.unbind())",
    )
    layout = str(t.layout).replace("torch.", "")
    check(
        fn_name,
        t.layout == torch.strided,
        f"{arg} is a {layout} tensor of shape {tuple(t.shape)}; the builders take strided (dense) "
        f"blocks: pass {arg}.to_dense()",
    )


def as_blocks(fn_name: str, blocks: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Return ``blocks`` as one ``[G, r, c]`` tensor, checking the shapes.

    Accepts a 3-D tensor or a non-empty sequence of equal-shaped 2-D tensors
    (stacked, so gradients flow back to the sequence's elements).
    """
    if isinstance(blocks, torch.Tensor):
        _check_strided_block(fn_name, "blocks", blocks)
        check(
            fn_name,
            blocks.dim() == 3,
            f"blocks must be a [G, rows, cols] tensor, got shape {tuple(blocks.shape)}",
        )
        out = blocks
    else:
        blocks = list(blocks)
        check(fn_name, len(blocks) > 0, "blocks is an empty sequence")
        for g, b in enumerate(blocks):
            check(
                fn_name,
                isinstance(b, torch.Tensor) and b.dim() == 2,
                f"blocks[{g}] must be a 2-D tensor, got "
                f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}",
            )
            _check_strided_block(fn_name, f"blocks[{g}]", b)
            check(
                fn_name,
                b.shape == blocks[0].shape,
                f"blocks[{g}] has shape {tuple(b.shape)} but blocks[0] has shape "
                f"{tuple(blocks[0].shape)}; all blocks must have one shape",
            )
            check_same_device_dtype(fn_name, **{"blocks[0]": blocks[0], f"blocks[{g}]": b})
        out = torch.stack(blocks)
    check_float(fn_name, "blocks", out)
    check(
        fn_name,
        out.shape[0] >= 1 and out.shape[1] >= 1 and out.shape[2] >= 1,
        f"blocks must have G, rows, cols >= 1, got shape {tuple(out.shape)}",
    )
    return out
