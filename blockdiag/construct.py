"""Builders of block-diagonal matrices (dense, mask, CSR, BSR, COO), ``to_blocks`` and scipy interop.

Every builder takes ``blocks``: a ``[G, r, c]`` tensor or a sequence of equal-shaped 2-D
tensors, and returns a ``[G*r, G*c]`` matrix on the blocks' device and dtype whose block
``g`` (rows ``g*r:(g+1)*r``, columns ``g*c:(g+1)*c``) is ``blocks[g]``. All builders are
differentiable with respect to ``blocks`` and the gradient is compact (never a dense
``[G*r, G*c]`` gradient).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from typing import Any, Sequence

import torch

from ._checks import as_blocks, as_size, as_sizes, check, is_int
from ._errors import BlockDiagError
from .layout import BlockLayout, _coo_indices, _csr_indices

__all__ = [
    "block_diag_dense",
    "block_diag_mask",
    "block_diag_csr",
    "block_diag_bsr",
    "block_diag_coo",
    "to_blocks",
    "to_scipy",
    "from_scipy",
]

Blocks = torch.Tensor | Sequence[torch.Tensor]

LAYOUTS = ("dense", "csr", "bsr", "coo", "blocks")


def _layout_of(blocks: torch.Tensor) -> BlockLayout:
    g, r, c = blocks.shape
    return BlockLayout(g, r, c)


def dense_from_blocks(w: torch.Tensor) -> torch.Tensor:
    """``[G, r, c] -> [G*r, G*c]`` without argument checks (the backends' hot path)."""
    g, r, c = w.shape
    if g == 1:
        return w[0]
    if type(w) in _PLAIN and not (torch.is_grad_enabled() and w.requires_grad) and not (
            torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling()):
        # Nothing differentiates through the matrix (the backends' kernels run below
        # autograd): the blocks are written into its zeros, in the layout it is returned in.
        # diag_embed's [r, c, G, G] result is a second matrix-sized tensor that the reshape
        # copies, so that path holds two dense matrices at its peak.
        out = w.new_zeros(g, r, g, c)
        out.diagonal(dim1=0, dim2=2).copy_(w.permute(1, 2, 0))
        return out.view(g * r, g * c)
    # diag_embed places W[g] at [:, :, g, g]; its backward reads the diagonal back, so the
    # gradient w.r.t. the blocks is compact and nothing outside the blocks receives one.
    # Out of place, as torch.func transforms and traced graphs need it.
    out = torch.diag_embed(w.permute(1, 2, 0))  # [r, c, G, G]
    return out.permute(2, 0, 3, 1).reshape(g * r, g * c)


# The tensor types dense_from_blocks writes the blocks into a new matrix for (a subclass may
# carry anything, such as a DTensor's placements, that the in-place write would not keep).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def block_diag_dense(blocks: Blocks) -> torch.Tensor:
    """Dense block-diagonal matrix from ``G`` equal-shaped blocks.

    >>> w = torch.arange(8.).reshape(2, 2, 2)
    >>> block_diag_dense(w)
    tensor([[0., 1., 0., 0.],
            [2., 3., 0., 0.],
            [0., 0., 4., 5.],
            [0., 0., 6., 7.]])

    Args:
        blocks: ``[G, r, c]`` tensor or a sequence of ``G`` tensors of shape ``[r, c]``.

    Returns:
        a new ``[G*r, G*c]`` tensor (never a view of ``blocks``, as ``torch.block_diag``
            gives), differentiable w.r.t. ``blocks``.

    Raises:
        BlockDiagError: if the blocks are not 2-D, differ in shape, dtype or device,
            or are not floating point.
    """
    w = as_blocks("block_diag_dense", blocks)
    # One block is the matrix itself: dense_from_blocks returns it as a view (the dense
    # backend's hot path needs no copy); a caller writing into the result must not write
    # into the blocks.
    return dense_from_blocks(w) if w.shape[0] > 1 else w[0].clone()


def block_diag_mask(
    groups: int, block_shape: tuple[int, int], *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool mask of a block-diagonal matrix: True inside the ``groups`` diagonal blocks.

    >>> block_diag_mask(2, (1, 2)).int()
    tensor([[1, 1, 0, 0],
            [0, 0, 1, 1]], dtype=torch.int32)

    Args:
        groups: number of blocks ``G``.
        block_shape: ``(r, c)``, the shape of one block.
        device: where to put the mask (default: CPU).

    Returns:
        bool tensor ``[G*r, G*c]``.

    Raises:
        BlockDiagError: if ``groups`` or the block shape are not positive ints.
    """
    groups = as_size(groups)
    block_shape = as_sizes(block_shape)
    check(
        "block_diag_mask",
        is_int(groups, 1),
        f"groups must be a positive int, got {groups!r}",
    )
    check(
        "block_diag_mask",
        _two_positive_ints(block_shape),
        f"block_shape must be two positive ints (rows, cols), got {block_shape!r}",
    )
    r, c = block_shape
    return BlockLayout(groups, r, c).mask(device)


def _two_positive_ints(v) -> bool:
    """A pair of positive ints (bools are not sizes)."""
    return (
        isinstance(v, (tuple, list, torch.Size))
        and len(v) == 2
        and all(is_int(k, 1) for k in v)
    )


def _sparse_csr(w: torch.Tensor, own_indices: bool = False) -> torch.Tensor:
    # The index tensors are cached per layout and shared by every product of that shape, in
    # int32 where the entries fit (torch's CSR products take either; the column index is one
    # per stored entry, so int64 cost twice a float32 weight's bytes for as long as the cache
    # holds it). A matrix handed to users gets int64 indices of its own (own_indices), built
    # for it and not cached: torch's default index dtype, and editing them in place cannot
    # corrupt later products.
    lay = _layout_of(w)
    if own_indices:
        crow, col = _csr_indices.__wrapped__(lay.groups, lay.block_out, lay.block_in, w.device)
    else:
        small = lay.nnz <= torch.iinfo(torch.int32).max
        crow, col = lay.csr_indices(w.device, torch.int32 if small else torch.int64)
    # Row k of block g holds W[g, k % r, :]: the CSR values are W flattened, no gather needed.
    # device=: torch's sparse constructors put the matrix on the default device (a
    # ``torch.device(...)`` context, ``set_default_device``), not on their operands'.
    return torch.sparse_csr_tensor(
        crow, col, w.reshape(-1), lay.shape, device=w.device, check_invariants=False
    )


def _bsr_values(w: torch.Tensor, blocksize: tuple[int, int]) -> torch.Tensor:
    g, r, c = w.shape
    p, q = blocksize
    if (p, q) == (r, c):
        return w
    return w.reshape(g, r // p, p, c // q, q).permute(0, 1, 3, 2, 4).reshape(-1, p, q)


def _sparse_bsr(w: torch.Tensor, blocksize: tuple[int, int], own_indices: bool = False) -> torch.Tensor:
    lay = _layout_of(w)
    if own_indices:  # see _sparse_csr: built for the caller, not cached
        p, q = blocksize
        crow, col = _csr_indices.__wrapped__(lay.groups, lay.block_out // p, lay.block_in // q, w.device)
    else:
        crow, col = lay.bsr_indices(blocksize, w.device)
    return torch.sparse_bsr_tensor(  # device=: see _sparse_csr
        crow, col, _bsr_values(w, blocksize), lay.shape, device=w.device, check_invariants=False
    )


def block_diag_csr(blocks: Blocks) -> torch.Tensor:
    """Sparse CSR block-diagonal matrix; stored values are exactly the block entries.

    Explicit zeros inside a block are stored; nothing outside the blocks is.

    >>> m = block_diag_csr(torch.ones(3, 2, 2))
    >>> m.layout, m.shape, m.values().numel()
    (torch.sparse_csr, torch.Size([6, 6]), 12)

    Args:
        blocks: ``[G, r, c]`` tensor or a sequence of ``[r, c]`` tensors.

    Returns:
        ``torch.sparse_csr`` tensor ``[G*r, G*c]``; its ``values()`` are
            ``blocks.reshape(-1)`` (differentiable w.r.t. ``blocks``), the blocks' own
            storage where ``blocks`` is a contiguous tensor, as torch's sparse constructors
            take their values: writing into one writes into the other.

    Raises:
        BlockDiagError: on malformed blocks (see :func:`block_diag_dense`).
    """
    w = as_blocks("block_diag_csr", blocks)
    return _sparse_csr(w.contiguous(), own_indices=True)


def block_diag_bsr(blocks: Blocks, blocksize: tuple[int, int] | None = None) -> torch.Tensor:
    """Sparse BSR block-diagonal matrix.

    >>> m = block_diag_bsr(torch.ones(3, 4, 2), blocksize=(2, 2))
    >>> m.layout, m.values().shape
    (torch.sparse_bsr, torch.Size([6, 2, 2]))

    Args:
        blocks: ``[G, r, c]`` tensor or a sequence of ``[r, c]`` tensors.
        blocksize: ``(p, q)`` dividing ``(r, c)``; default ``(r, c)``, one stored block per
            diagonal block. (Some torch kernels, e.g. MKL on CPU, need square blocks;
            ``(g, g)`` with ``g = math.gcd(r, c)`` always divides.)

    Returns:
        ``torch.sparse_bsr`` tensor ``[G*r, G*c]``; with the default blocksize its
            ``values()`` are the blocks, in their own storage where ``blocks`` is a
            contiguous tensor (see :func:`block_diag_csr`).

    Raises:
        BlockDiagError: on malformed blocks or a blocksize that does not divide the block shape.
    """
    w = as_blocks("block_diag_bsr", blocks)
    _, r, c = w.shape
    bs = (r, c) if blocksize is None else blocksize
    bs = as_sizes(bs)
    check(
        "block_diag_bsr",
        _two_positive_ints(bs),
        f"blocksize must be two positive ints, got {blocksize!r}",
    )
    bs = tuple(bs)
    check(
        "block_diag_bsr",
        r % bs[0] == 0 and c % bs[1] == 0,
        f"blocksize={bs} must divide the block shape ({r}, {c})",
    )
    return _sparse_bsr(w.contiguous(), bs, own_indices=True)  # type: ignore[arg-type]


def block_diag_coo(blocks: Blocks) -> torch.Tensor:
    """Sparse COO (coalesced) block-diagonal matrix.

    >>> m = block_diag_coo(torch.ones(2, 1, 3))
    >>> m.indices().tolist()
    [[0, 0, 0, 1, 1, 1], [0, 1, 2, 3, 4, 5]]

    Args:
        blocks: ``[G, r, c]`` tensor or a sequence of ``[r, c]`` tensors.

    Returns:
        coalesced ``torch.sparse_coo`` tensor ``[G*r, G*c]`` whose values are
            ``blocks.reshape(-1)``, in the blocks' own storage where ``blocks`` is a
            contiguous tensor (see :func:`block_diag_csr`).

    Raises:
        BlockDiagError: on malformed blocks (see :func:`block_diag_dense`).
    """
    w = as_blocks("block_diag_coo", blocks)
    lay = _layout_of(w)
    # Built for the caller, not taken from the layout's cache (see _sparse_csr): two int64
    # indices per stored entry, four times a float32 weight's bytes, would stay cached for the
    # life of the process after the matrix is gone.
    return torch.sparse_coo_tensor(
        _coo_indices.__wrapped__(lay.groups, lay.block_out, lay.block_in, w.device),
        w.reshape(-1),
        lay.shape,
        device=w.device,  # see _sparse_csr
        is_coalesced=True,
        check_invariants=False,
    )


def _first_offdiag(rows: torch.Tensor, cols: torch.Tensor, r: int, c: int) -> int | None:
    """The index of the first entry outside the diagonal blocks in row-major order, or None."""
    bad = ((rows // r) != (cols // c)).nonzero().flatten()
    if bad.numel() == 0:
        return None
    # The least (row, col), whatever order the entries come in: torch's coalesced indices are
    # row-major, but scipy before 1.13 sums a COO matrix's duplicates into column-major order.
    br, bc = rows[bad], cols[bad]
    top = br == br.min()
    return int(bad[top][bc[top].argmin()])


def _blocks_from_coo(
    fn: str, rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor, shape, groups: int, arg: str = "matrix"
) -> torch.Tensor:
    r, c = shape[0] // groups, shape[1] // groups
    nz = vals != 0
    k = _first_offdiag(rows[nz], cols[nz], r, c)
    if k is not None:
        i, j = int(rows[nz][k]), int(cols[nz][k])
        raise BlockDiagError(
            f"{fn}: {arg} of shape {tuple(shape)} has a non-zero {vals[nz][k].item()!r} at "
            f"({i}, {j}), outside the {groups} diagonal blocks of shape ({r}, {c})"
        )
    out = torch.zeros(groups, r, c, dtype=vals.dtype, device=vals.device)
    inside = (rows // r) == (cols // c)  # stored zeros off the diagonal are dropped
    rows, cols, vals = rows[inside], cols[inside], vals[inside]
    # torch has no index_put for uint16/32/64 (a scipy matrix of them reaches here): the
    # signed type of the same width is scattered instead, whose wrapping sum has the same bits.
    signed = _SIGNED_OF.get(vals.dtype)
    target, vals = (out, vals) if signed is None else (out.view(signed), vals.view(signed))
    target.index_put_((rows // r, rows % r, cols % c), vals, accumulate=True)
    return out


_SIGNED_OF = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _import_scipy(module: str, fn: str, missing: str):
    """SciPy's ``module``, imported on first use for ``fn``: SciPy is an optional dependency.

    Only a SciPy that is absent gets the ``missing`` advice (how to install it); one that is
    installed but fails to import (a shared library missing, built for another numpy) gets
    its own error, since installing it again changes nothing.

    Raises:
        ImportError: naming ``fn`` and either how to install SciPy or why it did not import.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if importlib.util.find_spec("scipy") is None:  # absent, or hidden by a None in sys.modules
            raise ImportError(f"{fn} needs SciPy, which is not installed: {missing}") from e
        raise ImportError(f"{fn} needs SciPy, which is installed but does not import: {e}") from e


def _scipy_sparse(fn: str):
    """``scipy.sparse``, imported on first use (see :func:`_import_scipy`).

    Raises:
        ImportError: naming ``fn`` and how to install SciPy, or why it did not import.
    """
    return _import_scipy("scipy.sparse", fn, "pip install 'scipy>=1.10' (or the blockdiag "
                         "checkout's scipy extra, pip install -e '.[scipy]')")


def to_blocks(matrix: Any, groups: int) -> torch.Tensor:
    """Extract the ``[G, r, c]`` diagonal blocks of a block-diagonal matrix.

    Accepts a dense tensor, a torch sparse tensor (COO, CSR, CSC, BSR, BSC) or a scipy
    sparse matrix/array. Refuses (rather than silently dropping) any non-zero outside the
    diagonal blocks.

    >>> to_blocks(block_diag_csr(torch.ones(2, 1, 2)), 2)
    tensor([[[1., 1.]],
    <BLANKLINE>
            [[1., 1.]]])

    Args:
        matrix: a 2-D block-diagonal matrix of shape ``[G*r, G*c]``.
        groups: ``G``.

    Returns:
        ``[G, r, c]`` tensor (dense, same device and dtype; from scipy: CPU, numpy's dtype).

    Raises:
        BlockDiagError: if ``matrix`` is not 2-D, ``groups`` does not divide its shape, or any
            entry outside the diagonal blocks is non-zero (the message names the first one).
    """
    return _to_blocks("to_blocks", "matrix", matrix, groups)


def _to_blocks(fn: str, arg: str, matrix: Any, groups: int) -> torch.Tensor:
    """:func:`to_blocks` for ``fn``, whose messages name its argument ``arg``."""
    groups = as_size(groups)
    if not isinstance(matrix, torch.Tensor):
        # A scipy matrix means scipy.sparse is imported already: without it, none can exist
        # here, and SciPy (an optional dependency) is not imported to say so.
        sp = sys.modules.get("scipy.sparse")
        check(
            fn,
            sp is not None and sp.issparse(matrix),
            f"{arg} must be a torch tensor or a scipy sparse matrix, got {type(matrix).__name__}",
        )
        check(fn, len(matrix.shape) == 2, f"{arg} must be 2-D, got shape {tuple(matrix.shape)}")
        # A copy (tocoo may return the caller's own array), with duplicates summed as the
        # torch path coalesces: +1 and -1 at one place are a zero, not a stray entry.
        coo = matrix.tocoo(copy=True)
        coo.sum_duplicates()
        rows = torch.from_numpy(coo.row.astype("int64"))
        cols = torch.from_numpy(coo.col.astype("int64"))
        try:
            vals = torch.from_numpy(coo.data)
        except TypeError:
            raise BlockDiagError(
                f"{fn}: {arg} has dtype {coo.data.dtype}, which torch has no dtype for; convert it first "
                f"({arg}.astype(numpy.float64))"
            ) from None
        shape = coo.shape
        _check_shape(fn, shape, groups, arg)
        return _blocks_from_coo(fn, rows, cols, vals, shape, groups, arg)
    check(fn, matrix.dim() == 2, f"{arg} must be 2-D, got shape {tuple(matrix.shape)}")
    shape = tuple(matrix.shape)
    _check_shape(fn, shape, groups, arg)
    r, c = shape[0] // groups, shape[1] // groups
    if matrix.layout == torch.strided:
        m = matrix.view(groups, r, groups, c) if matrix.is_contiguous() else matrix.reshape(
            groups, r, groups, c
        )
        idx = torch.arange(groups, device=matrix.device)
        blocks = m[idx, :, idx, :]  # [G, r, c]
        # The non-zeros with the diagonal blocks cleared in place: one bool tensor the size of
        # the matrix, where a mask and its complement would be two more.
        off = matrix.ne(0).contiguous()  # a view below needs it (a transposed matrix gives a transposed one)
        off.view(groups, r, groups, c)[idx, :, idx, :] = False
        # A meta matrix holds no values to check: its blocks are taken as they are.
        if not matrix.is_meta and bool(off.any()):
            i, j = (int(v) for v in off.nonzero()[0])
            raise BlockDiagError(
                f"{fn}: {arg} of shape {shape} has a non-zero {matrix[i, j].item()!r} at "
                f"({i}, {j}), outside the {groups} diagonal blocks of shape ({r}, {c})"
            )
        return blocks
    if matrix.layout == torch.sparse_coo:
        check(
            fn,
            matrix.sparse_dim() == 2 and matrix.dense_dim() == 0,
            f"{arg} is a hybrid COO tensor ({matrix.sparse_dim()} sparse and {matrix.dense_dim()} dense "
            f"dimensions, shape {shape}); only plain 2-D matrices hold blocks",
        )
    if matrix.is_meta:  # no indices to read: the blocks' shape, as for a dense meta matrix
        return torch.empty(groups, r, c, dtype=matrix.dtype, device=matrix.device)
    coo = matrix.to_sparse_coo().coalesce() if matrix.layout != torch.sparse_coo else matrix.coalesce()
    rows, cols = coo.indices()
    return _blocks_from_coo(fn, rows, cols, coo.values(), shape, groups, arg)


def _check_shape(fn: str, shape, groups: int, arg: str = "matrix") -> None:
    # ``arg``: the caller's name for the matrix (from_scipy's is ``spmatrix``).
    check(
        fn,
        is_int(groups, 1),
        f"groups must be a positive int, got {groups!r}",
    )
    # Checked apart from the divisibility: groups divides an empty side, which a message
    # saying that it must would contradict.
    check(
        fn,
        shape[0] > 0 and shape[1] > 0,
        f"{arg} of shape {tuple(shape)} has an empty side; its blocks must have rows, cols >= 1, "
        "as the builders' blocks do",
    )
    check(
        fn,
        shape[0] % groups == 0 and shape[1] % groups == 0,
        f"groups={groups} must divide both dimensions of {arg} (shape {tuple(shape)})",
    )


def to_scipy(matrix: torch.Tensor):
    """Convert a torch matrix to the scipy sparse array of the matching format.

    CSR -> ``csr_array``, BSR -> ``bsr_array`` (same blocksize), COO -> ``coo_array``,
    CSC -> ``csc_array``; a dense tensor becomes a ``csr_array`` holding its non-zeros.
    Values and indices are copied to CPU (and detached): the scipy array shares no memory
    with ``matrix``, nor with the blocks a builder's matrix holds, so scipy's in-place
    methods (``eliminate_zeros``, ``*=``) leave both alone.

    >>> to_scipy(block_diag_csr(torch.ones(2, 1, 1))).toarray()
    array([[1., 0.],
           [0., 1.]], dtype=float32)

    Args:
        matrix: 2-D torch tensor (strided, COO, CSR, CSC or BSR).

    Returns:
        a ``scipy.sparse`` array.

    Raises:
        BlockDiagError: for tensors that are not 2-D, on the meta device, of a dtype numpy
            lacks (bfloat16, float8, complex32) or float16, hybrid COO tensors, or of an
            unsupported layout.
        ImportError: where SciPy (an optional dependency) is not installed.
    """
    fn = "to_scipy"
    sp = _scipy_sparse(fn)
    check(fn, isinstance(matrix, torch.Tensor), f"matrix must be a tensor, got {type(matrix).__name__}")
    check(fn, matrix.dim() == 2, f"matrix must be 2-D, got shape {tuple(matrix.shape)}")
    name = str(matrix.dtype).removeprefix("torch.")
    check(
        fn,
        _numpy_has(matrix.dtype),
        f"matrix is {name}, which numpy and scipy do not have; convert it first "
        f"({'matrix.to(torch.complex64)' if matrix.is_complex() else 'matrix.float()'})",
    )
    # numpy has float16 but scipy.sparse does not: a CSR array of it is built, then fails
    # in its first product.
    check(
        fn,
        matrix.dtype != torch.float16,
        "matrix is float16, which scipy.sparse does not support; convert it first (matrix.float())",
    )
    check(fn, not matrix.is_meta, "matrix is on the meta device, which holds no values to convert")
    # A COO tensor of one sparse and one dense dimension is 2-D too: its values are rows, which
    # no scipy format holds.
    check(
        fn,
        matrix.layout != torch.sparse_coo or matrix.sparse_dim() == 2,
        f"matrix is a hybrid COO tensor ({matrix.sparse_dim()} sparse and {matrix.dense_dim()} dense "
        f"dimensions, shape {tuple(matrix.shape)}); convert it first (matrix.to_dense().to_sparse())",
    )
    m = matrix.detach().cpu()
    shape = tuple(m.shape)

    def arr(t: torch.Tensor):
        # numpy() refuses a view with the conjugate or negative bit set (matrix.conj()).
        # A copy: numpy() of a CPU tensor is its storage, and scipy's constructors keep the
        # arrays they are given, so scipy's in-place methods (eliminate_zeros, *=, sort_indices)
        # would rewrite the tensor (a builder's values are the caller's blocks) and leave its
        # indices inconsistent.
        return t.resolve_conj().resolve_neg().numpy().copy()

    if m.layout == torch.sparse_csr:
        return sp.csr_array((arr(m.values()), arr(m.col_indices()), arr(m.crow_indices())), shape=shape)
    if m.layout == torch.sparse_csc:
        return sp.csc_array((arr(m.values()), arr(m.row_indices()), arr(m.ccol_indices())), shape=shape)
    if m.layout == torch.sparse_bsr:
        return sp.bsr_array((arr(m.values()), arr(m.col_indices()), arr(m.crow_indices())), shape=shape)
    if m.layout == torch.sparse_coo:
        m = m.coalesce()
        return sp.coo_array((arr(m.values()), tuple(arr(m.indices()))), shape=shape)
    if m.layout == torch.strided:
        return sp.csr_array(arr(m))
    raise BlockDiagError(f"{fn}: unsupported layout {m.layout}")


def _numpy_has(dtype: torch.dtype) -> bool:
    """Whether numpy has ``dtype`` (bfloat16, the float8 types and complex32 it has not)."""
    try:
        # On the CPU whatever the default device (a ``torch.device(...)`` context,
        # ``set_default_device``): .numpy() of a tensor elsewhere is a TypeError too.
        torch.empty(0, dtype=dtype, device="cpu").numpy()
    except TypeError:
        return False
    return True


def from_scipy(
    spmatrix: Any,
    groups: int,
    *,
    layout: str = "csr",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Build a torch block-diagonal matrix (or its blocks) from a scipy sparse matrix.

    >>> import scipy.sparse as sp
    >>> from_scipy(sp.eye(4, format="csr"), 2, layout="blocks").shape
    torch.Size([2, 2, 2])

    Args:
        spmatrix: scipy sparse matrix or array, block-diagonal with ``groups`` blocks.
        groups: ``G``.
        layout: one of ``"dense"``, ``"csr"``, ``"bsr"``, ``"coo"``, ``"blocks"``
            (the ``[G, r, c]`` tensor).
        device: target device (default CPU).
        dtype: target dtype (default: numpy's dtype).

    Returns:
        tensor in the requested layout.

    Raises:
        BlockDiagError: unknown layout, shape not divisible, or off-diagonal non-zeros.
    """
    check(
        "from_scipy",
        layout in LAYOUTS,
        f"layout={layout!r} is not one of {', '.join(map(repr, LAYOUTS))}",
    )
    kind = getattr(getattr(spmatrix, "dtype", None), "kind", None)
    if dtype is not None and kind in ("f", "c"):
        import numpy as np

        try:
            torch.from_numpy(np.empty(0, spmatrix.dtype))
        except TypeError:
            # numpy's longdouble (or its complex): torch has none, and dtype says what to make
            # of it; through the widest dtype torch has, nothing a torch dtype keeps is lost.
            spmatrix = spmatrix.astype(np.float64 if kind == "f" else np.complex128)
    blocks = _to_blocks("from_scipy", "spmatrix", spmatrix, groups).to(device=device, dtype=dtype)
    check(
        "from_scipy",
        layout == "blocks" or blocks.is_floating_point(),
        f"layout={layout!r} builds a floating matrix, but the scipy matrix has dtype {spmatrix.dtype} "
        f"({blocks.dtype}); pass dtype= (e.g. dtype=torch.float32), or layout='blocks' to keep it",
    )
    return {
        "blocks": lambda b: b,
        "dense": block_diag_dense,
        "csr": block_diag_csr,
        "bsr": block_diag_bsr,
        "coo": block_diag_coo,
    }[layout](blocks)


def square_blocksize(block_out: int, block_in: int) -> tuple[int, int]:
    """The largest square blocksize dividing a ``(block_out, block_in)`` block (1 for an empty one).

    >>> square_blocksize(6, 4), square_blocksize(0, 3), square_blocksize(0, 0)
    ((2, 2), (3, 3), (1, 1))
    """
    s = math.gcd(block_out, block_in) or 1  # gcd(0, 0) is 0: every side divides an empty block
    return (s, s)
