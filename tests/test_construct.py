"""Builders, ``to_blocks`` and scipy interop against ``scipy.linalg.block_diag``."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blockdiag
import blockdiag.testing
from blockdiag import (
    BlockDiagError,
    block_diag_bsr,
    block_diag_coo,
    block_diag_csr,
    block_diag_dense,
    block_diag_mask,
    from_scipy,
    to_blocks,
    to_scipy,
)

from _params import DEVICES, DTYPES

BUILDERS = {
    "dense": (block_diag_dense, torch.strided),
    "csr": (block_diag_csr, torch.sparse_csr),
    "bsr": (block_diag_bsr, torch.sparse_bsr),
    "coo": (block_diag_coo, torch.sparse_coo),
}


def _scipy_dense(blocks: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(scipy.linalg.block_diag(*blocks.detach().cpu().numpy()))


def _blocks(g, r, c, dtype=torch.float64, device="cpu", zeros=False):
    b = torch.randn(g, r, c, dtype=dtype, device=device)
    if zeros:  # explicit zeros inside a block must survive every layout
        b[..., 0] = 0.0
    return b


@pytest.mark.parametrize("layout", list(BUILDERS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g, r, c", [(1, 1, 1), (3, 2, 5), (4, 6, 4), (2, 1, 3)], ids=lambda v: str(v))
def test_builder_matches_scipy(layout, device, dtype, g, r, c):
    build, torch_layout = BUILDERS[layout]
    b = _blocks(g, r, c, dtype, device, zeros=True)
    m = build(b)
    assert m.layout == torch_layout and m.shape == (g * r, g * c)
    assert m.dtype == dtype and m.device.type == device
    dense = m.to_dense() if layout != "dense" else m
    torch.testing.assert_close(dense.cpu(), _scipy_dense(b))
    if layout in ("csr", "coo"):
        # exactly the block entries are stored: explicit zeros kept, nothing outside
        assert m._nnz() == g * r * c
        vals = m.values() if layout == "csr" else m.coalesce().values()
        assert int((vals == 0).sum()) == g * r
    if layout == "bsr":
        assert m.values().shape == (g, r, c)  # default blocksize is the block shape
    torch.testing.assert_close(to_blocks(m, g), b)


def test_builders_accept_sequences_and_are_differentiable():
    parts = [torch.randn(2, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    for layout, (build, _) in BUILDERS.items():
        m = build(parts)
        dense = m if layout == "dense" else m.to_dense()
        weights = torch.randn(dense.shape, dtype=torch.float64)
        grads = torch.autograd.grad((dense * weights).sum(), parts)
        for k, gk in enumerate(grads):
            torch.testing.assert_close(gk, weights[2 * k:2 * k + 2, 3 * k:3 * k + 3], msg=layout)


def test_dense_gradcheck():
    b = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(block_diag_dense, (b,))


@pytest.mark.parametrize("blocks", [(6, 5, 7), (4, 1, 9), (3, 8, 1)], ids=["5x7", "1x9", "8x1"])
def test_the_dense_matrix_is_built_without_a_second_matrix_sized_tensor(blocks):
    # The dense backend's kernels build [G*out, G*in] from the blocks below autograd.
    # diag_embed's [out, in, G, G] result, then the reshape's copy, held two such matrices
    # at the peak: twice the memory of the matrix the GEMM reads, in forward and backward.
    from blockdiag.construct import dense_from_blocks
    from blockdiag.tuning import peak_memory

    w = torch.randn(*blocks)
    g, r, c = blocks
    want = torch.block_diag(*w)
    with torch.no_grad():
        assert peak_memory(lambda: dense_from_blocks(w)) == want.nbytes
        got = dense_from_blocks(w)
    assert torch.equal(got, want) and got.is_contiguous()
    # Recorded by autograd it stays differentiable, with a compact gradient.
    wg = w.clone().requires_grad_()
    gy = torch.randn(g * r, g * c)
    (gw,) = torch.autograd.grad(dense_from_blocks(wg), wg, gy)
    torch.testing.assert_close(gw, torch.stack([gy[k * r:(k + 1) * r, k * c:(k + 1) * c] for k in range(g)]))
    x = torch.randn(3, g * c)
    torch.testing.assert_close(blockdiag.grouped_linear(x, w, backend="dense"), x @ want.t())


@pytest.mark.parametrize("layout", list(BUILDERS))
@pytest.mark.parametrize("g", [1, 3])
def test_which_builders_share_the_blocks_storage(layout, g):
    # The dense matrix is always new: with one block the builder returned the block itself
    # (a view), so writing into the matrix wrote into the caller's weights, which
    # torch.block_diag never does. The sparse matrices' values are the blocks, as torch's
    # sparse constructors take their values (documented).
    b = torch.randn(g, 2, 3)
    kept = b.clone()
    m = BUILDERS[layout][0](b)
    vals = m if layout == "dense" else m.coalesce().values() if layout == "coo" else m.values()
    vals.add_(1.0)
    assert torch.equal(b, kept if layout == "dense" else kept + 1.0), layout


def test_bsr_blocksize():
    b = _blocks(2, 4, 6)
    m = block_diag_bsr(b, blocksize=(2, 2))
    assert m.values().shape[1:] == (2, 2)
    torch.testing.assert_close(m.to_dense(), _scipy_dense(b))
    with pytest.raises(BlockDiagError, match=r"blocksize.*\(3, 3\).*\(4, 6\)"):
        block_diag_bsr(b, blocksize=(3, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_mask(device):
    m = block_diag_mask(3, (2, 4), device=device)
    assert m.dtype == torch.bool and m.device.type == device
    want = scipy.linalg.block_diag(*np.ones((3, 2, 4), dtype=bool))
    assert (m.cpu().numpy() == want).all()
    m[0, 0] = False  # a fresh tensor: mutating it must not corrupt the cache
    assert bool(block_diag_mask(3, (2, 4), device=device)[0, 0])


@pytest.mark.parametrize("groups,shape", [(1, (3, 4)), (1, (1, 1)), (4, (1, 1)), (3, (1, 2)), (3, (2, 1))])
def test_mask_is_a_writable_contiguous_tensor(groups, shape):
    # One group made the reshape a view of one expanded element (strides (0, 0)): writing one
    # entry wrote them all, and an in-place op with another tensor raised.
    m = block_diag_mask(groups, shape)
    assert m.is_contiguous() and m.all(dim=None) == (groups == 1)
    m[0, 0] = False
    assert int(m.sum()) == groups * shape[0] * shape[1] - 1
    m &= torch.ones_like(m)


@settings(max_examples=40, deadline=None)
@given(
    g=st.integers(1, 6),
    r=st.integers(1, 6),
    c=st.integers(1, 6),
    layout=st.sampled_from(["dense", "csr", "bsr", "coo", "scipy-csr", "scipy-bsr", "scipy-coo"]),
    zeros=st.booleans(),
)
def test_roundtrip_hypothesis(g, r, c, layout, zeros):
    b = _blocks(g, r, c, zeros=zeros)
    if layout.startswith("scipy-"):
        fmt = layout.split("-")[1]
        m = to_scipy(BUILDERS[fmt][0](b))
        assert m.format == fmt
        np.testing.assert_array_equal(m.toarray(), _scipy_dense(b).numpy())
        back = from_scipy(m, g, layout="blocks")
        for out in ("dense", "csr", "bsr", "coo"):
            torch.testing.assert_close(to_blocks(from_scipy(m, g, layout=out), g), b)
    else:
        back = to_blocks(BUILDERS[layout][0](b), g)
    torch.testing.assert_close(back, b)


def test_to_scipy_dense_and_from_scipy_dtype_device():
    b = _blocks(2, 2, 3)
    m = to_scipy(block_diag_dense(b))
    assert m.format == "csr"
    t = from_scipy(m, 2, layout="dense", dtype=torch.float32)
    assert t.dtype == torch.float32
    torch.testing.assert_close(t, _scipy_dense(b).float())


@pytest.mark.parametrize("kind", ["dense", "csr", "coo", "bsr", "scipy"])
def test_to_blocks_names_first_offdiagonal_nonzero(kind):
    m = _scipy_dense(_blocks(3, 2, 2))
    m[1, 4] = 7.5
    m[5, 0] = 1.0
    mat = {
        "dense": lambda: m,
        "csr": lambda: m.to_sparse_csr(),
        "coo": lambda: m.to_sparse(),
        "bsr": lambda: m.to_sparse_bsr((1, 1)),
        "scipy": lambda: sp.csr_array(m.numpy()),
    }[kind]()
    with pytest.raises(BlockDiagError, match=r"to_blocks: .*\(6, 6\).*7\.5 at \(1, 4\)"):
        to_blocks(mat, 3)


def test_to_blocks_names_first_offdiagonal_nonzero_in_any_entry_order():
    # scipy before 1.13 sums a COO matrix's duplicates into column-major order, and the
    # message named (5, 0), the first entry in that order, for a matrix whose first is (1, 4).
    from blockdiag.construct import _blocks_from_coo

    rows, cols = torch.tensor([0, 5, 1, 0]), torch.tensor([0, 0, 4, 1])  # column-major
    with pytest.raises(BlockDiagError, match=r"to_blocks: .*\(6, 6\).*7\.5 at \(1, 4\)"):
        _blocks_from_coo("to_blocks", rows, cols, torch.tensor([1.0, 1.0, 7.5, 1.0]), (6, 6), 3)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: to_blocks(torch.zeros(6, 4), 4), r"groups=4 must divide both dimensions.*\(6, 4\)"),
        (lambda: to_blocks(torch.zeros(6), 2), r"matrix must be 2-D, got shape \(6,\)"),
        (lambda: to_blocks([[1.0]], 1), r"matrix must be a torch tensor or a scipy sparse matrix, got list"),
        (lambda: block_diag_dense(torch.zeros(2, 3)), r"blocks must be a \[G, rows, cols\] tensor, got shape \(2, 3\)"),
        (lambda: block_diag_csr([torch.zeros(2, 3), torch.zeros(3, 2)]), r"blocks\[1\] has shape \(3, 2\) but blocks\[0\] has shape \(2, 3\)"),
        (lambda: block_diag_coo([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)]), r"float64.*float32|float32.*float64"),
        (lambda: block_diag_dense(torch.zeros(2, 3, 3, dtype=torch.int64)), r"int64"),
        (lambda: block_diag_dense([]), r"empty"),
        (lambda: block_diag_dense(torch.zeros(0, 2, 2)), r"blocks must have G, rows, cols >= 1, got shape \(0, 2, 2\)"),
        (lambda: block_diag_csr(torch.zeros(2, 0, 3)), r"blocks must have G, rows, cols >= 1, got shape \(2, 0, 3\)"),
        (lambda: block_diag_bsr(torch.zeros(2, 3, 0)), r"blocks must have G, rows, cols >= 1, got shape \(2, 3, 0\)"),
        (lambda: block_diag_mask(0, (2, 2)), r"groups must be a positive int, got 0"),
        (lambda: block_diag_mask(2, (2,)), r"block_shape must be two positive ints"),
        (lambda: from_scipy(sp.eye(4, format="csr"), 2, layout="csc"), r"layout='csc' is not one of"),
        (lambda: to_scipy(torch.zeros(2, 2, 2)), r"2-D, got shape \(2, 2, 2\)"),
    ],
    ids=["groups-not-dividing", "1d-matrix", "not-a-matrix", "2d-blocks", "unequal-blocks",
         "mixed-dtype", "int-blocks", "empty-blocks", "no-groups", "no-rows", "no-cols", "mask-groups", "mask-shape", "bad-layout", "3d-to-scipy"],
)
def test_bad_input(call, match):
    with pytest.raises(BlockDiagError, match=match):
        call()


@pytest.mark.parametrize("build", [blockdiag.block_diag_csr, blockdiag.block_diag_bsr], ids=["csr", "bsr"])
def test_returned_indices_are_not_the_shared_cache(build):
    # Editing a returned matrix's indices in place must not reach the backends' products.
    w = torch.randn(2, 2, 2)
    x = torch.randn(3, 4)
    m = build(torch.ones(2, 2, 2))
    idx = m.col_indices()
    idx.copy_(idx.flip(0))
    m.crow_indices().zero_()
    for name in ("csr", "bsr"):
        y = blockdiag.grouped_linear(x, w, backend=name)
        torch.testing.assert_close(y, blockdiag.testing.reference_loop(x, w, None))


@pytest.mark.parametrize(
    "call, match",
    [
        pytest.param(lambda: blockdiag.block_diag_bsr(torch.ones(2, 2, 2), 2), r"block_diag_bsr: blocksize must be two positive ints, got 2", id="bsr-int-blocksize"),
        pytest.param(lambda: blockdiag.block_diag_bsr(torch.ones(2, 2, 2), (True, 1)), r"got \(True, 1\)", id="bsr-bool-blocksize"),
        pytest.param(lambda: blockdiag.block_diag_mask(2, 3), r"block_shape must be two positive ints \(rows, cols\), got 3", id="mask-int-shape"),
        pytest.param(lambda: blockdiag.block_diag_mask(True, (2, 2)), r"groups must be a positive int, got True", id="mask-bool-groups"),
        pytest.param(lambda: blockdiag.to_blocks(torch.eye(4), True), r"to_blocks: groups must be a positive int, got True", id="to-blocks-bool-groups"),
    ],
)
def test_sizes_that_are_not_pairs_of_ints(call, match):
    with pytest.raises(BlockDiagError, match=match):
        call()


def test_to_blocks_sums_scipy_duplicates_and_leaves_the_input_alone():
    # +1 and -1 at (0, 3) are a zero outside the blocks, as the torch path (coalesce) says.
    m = sp.coo_array((np.array([1.0, -1.0, 2.0, 3.0]), (np.array([0, 0, 0, 2]), np.array([3, 3, 0, 3]))), shape=(4, 4))
    blocks = blockdiag.to_blocks(m, 2)
    assert blocks.tolist() == [[[2.0, 0.0], [0.0, 0.0]], [[0.0, 3.0], [0.0, 0.0]]]
    assert m.nnz == 4  # the caller's array is not coalesced in place
    torch_blocks = blockdiag.to_blocks(torch.sparse_coo_tensor(torch.from_numpy(np.stack([m.row, m.col])), torch.from_numpy(m.data), (4, 4), check_invariants=True), 2)
    torch.testing.assert_close(torch_blocks, blocks)


def test_to_blocks_refuses_a_hybrid_coo():
    h = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2, 3), (2, 3), check_invariants=True)
    with pytest.raises(BlockDiagError, match=r"to_blocks: matrix is a hybrid COO tensor \(1 sparse and 1 dense dimensions, shape \(2, 3\)\)"):
        blockdiag.to_blocks(h, 1)


@pytest.mark.parametrize("layout", ["dense", "csr", "coo"])
def test_to_scipy_names_float16(layout):
    # A CSR array of float16 was built and failed in its first product.
    m = torch.eye(4, dtype=torch.float16)
    m = {"dense": m, "csr": m.to_sparse_csr(), "coo": m.to_sparse()}[layout]
    with pytest.raises(BlockDiagError, match=r"to_scipy: matrix is float16, which scipy.sparse does not support"):
        blockdiag.to_scipy(m)


def test_to_blocks_of_a_meta_matrix_gives_meta_blocks():
    blocks = blockdiag.to_blocks(torch.empty(6, 9, device="meta"), 3)
    assert blocks.is_meta and blocks.shape == (3, 2, 3)


def test_to_scipy_names_bfloat16():
    with pytest.raises(BlockDiagError, match=r"to_scipy: matrix is bfloat16, which numpy and scipy do not have"):
        blockdiag.to_scipy(torch.ones(2, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32])
@pytest.mark.parametrize("layout", list(BUILDERS))
def test_to_scipy_names_every_dtype_numpy_lacks(dtype, layout):
    # The builders take the float8 types (floating point): their matrices reached numpy's TypeError.
    if dtype.is_complex:  # no builder takes complex blocks
        m = torch.eye(4).to(dtype)
    else:
        m = BUILDERS[layout][0](torch.ones(2, 2, 2).to(dtype))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(BlockDiagError, match=rf"to_scipy: matrix is {name}, which numpy and scipy do not have"):
        blockdiag.to_scipy(m)


def test_to_scipy_refuses_a_hybrid_coo():
    m = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 4), (4, 4))
    with pytest.raises(BlockDiagError, match=r"to_scipy: matrix is a hybrid COO tensor \(1 sparse and 1 dense"):
        blockdiag.to_scipy(m)


@pytest.mark.parametrize("layout", ["csr", "bsr", "coo"])
def test_to_blocks_of_a_sparse_meta_matrix_gives_meta_blocks(layout):
    # The sparse path read the indices (nonzero on meta): torch's NotImplementedError.
    m = BUILDERS[layout][0](torch.empty(2, 3, 4, device="meta"))
    blocks = to_blocks(m, 2)
    assert blocks.is_meta and blocks.shape == (2, 3, 4)


@pytest.mark.parametrize("layout", ["csr", "bsr", "coo"])
def test_sparse_builders_keep_the_blocks_device_under_another_default_device(layout):
    # torch's sparse constructors put a matrix on the default device, not on their values':
    # under torch.device("meta") (set_default_device("cuda") alike) CPU blocks gave a meta
    # matrix, whose values were no longer the blocks' storage.
    w = torch.randn(2, 3, 4)
    with torch.device("meta"):
        m = BUILDERS[layout][0](w)
    assert m.device == w.device and m.values().data_ptr() == w.data_ptr()
    torch.testing.assert_close(m.to_dense(), block_diag_dense(w))


@pytest.mark.parametrize("name", ["csr", "bsr"])
def test_sparse_backends_on_cpu_operands_under_another_default_device(name):
    # Their product ran on a meta matrix: NotImplementedError from torch's sparse addmm.
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 8, requires_grad=True), torch.randn(2, 3, 4, requires_grad=True), torch.randn(6)
    want = blockdiag.testing.reference_loop(x.detach(), w.detach(), b)
    with torch.device("meta"):
        y = blockdiag.grouped_linear(x, w, b, backend=name)
        y.sum().backward()
    assert y.device == x.device and x.grad.device == x.device and w.grad.device == w.device
    torch.testing.assert_close(y.detach(), want)


def test_to_scipy_under_another_default_device():
    # numpy's dtypes were probed with a tensor on the default device: on meta (or CUDA) its
    # .numpy() failed, and every matrix was refused as "float32, which numpy ... do not have".
    w = torch.randn(2, 3, 4)
    with torch.device("meta"):
        got = [to_scipy(f(w)).toarray() for f in (block_diag_dense, block_diag_csr)]
    for a in got:
        np.testing.assert_array_equal(a, block_diag_dense(w).numpy())


def test_to_scipy_refuses_meta_and_resolves_conjugate_and_negative_views():
    with pytest.raises(BlockDiagError, match=r"to_scipy: matrix is on the meta device"):
        to_scipy(torch.empty(2, 2, device="meta"))
    z = torch.tensor([[1 + 2j, 0], [0, 1j]])
    np.testing.assert_array_equal(to_scipy(z.conj()).toarray(), z.conj().resolve_conj().numpy())
    d = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    np.testing.assert_array_equal(to_scipy(torch._neg_view(d)).toarray(), -d.numpy())


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="numpy's longdouble is float64 here")
def test_a_scipy_dtype_torch_lacks_is_refused_or_converted_as_asked():
    a = sp.block_diag([np.ones((2, 2), dtype=np.longdouble)] * 3).tocsr()
    with pytest.raises(BlockDiagError, match=r"to_blocks: matrix has dtype float128, which torch has no dtype for"):
        blockdiag.to_blocks(a, 3)
    # A target dtype says what to make of it (it was a TypeError from torch before dtype applied).
    blocks = blockdiag.from_scipy(a, 3, layout="blocks", dtype=torch.float64)
    assert blocks.dtype == torch.float64 and torch.equal(blocks, torch.ones(3, 2, 2, dtype=torch.float64))



@pytest.mark.parametrize("np_dtype", [np.uint16, np.uint32, np.uint64])
def test_a_scipy_matrix_of_wide_unsigned_ints_gives_its_blocks(np_dtype):
    # torch has no index_put for these dtypes: to_blocks and from_scipy (even with a float
    # dtype asked for) raised its NotImplementedError, naming neither the function nor the matrix.
    top = np.iinfo(np_dtype).max
    blocks = np.array([[[1, top]], [[top, 2]]], dtype=np_dtype)
    a = sp.block_diag(list(blocks), format="csr")
    got = blockdiag.to_blocks(a, 2)
    np.testing.assert_array_equal(got.numpy(), blocks)
    m = blockdiag.from_scipy(a, 2, dtype=torch.float64, layout="dense")
    np.testing.assert_array_equal(m.numpy(), a.toarray().astype(np.float64))


@pytest.mark.parametrize("np_dtype", [np.int64, np.bool_, np.complex64])
@pytest.mark.parametrize("layout", ["dense", "csr", "bsr", "coo"])
def test_from_scipy_of_a_non_float_matrix_says_to_pass_dtype(np_dtype, layout):
    # The refusal came from the builder (block_diag_csr: "blocks must have a floating dtype").
    a = sp.block_diag([np.ones((2, 2), dtype=np_dtype)] * 3, format="csr")
    with pytest.raises(BlockDiagError, match=f"from_scipy: layout='{layout}' builds a floating matrix.*pass dtype="):
        blockdiag.from_scipy(a, 3, layout=layout)
    assert blockdiag.from_scipy(a, 3, layout="blocks").shape == (3, 2, 2)
    assert blockdiag.from_scipy(a, 3, layout=layout, dtype=torch.float32).to_dense().sum() == 12


def test_a_one_dimensional_scipy_array_is_refused():
    a = sp.coo_array(np.ones(6))
    if a.ndim != 1:
        pytest.skip(f"scipy {scipy.__version__} has no 1-D sparse arrays (1.13 and later): "
                    f"coo_array makes shape {a.shape}")
    with pytest.raises(BlockDiagError, match=r"to_blocks: matrix must be 2-D, got shape \(6,\)"):
        blockdiag.to_blocks(a, 3)


def test_layout_cache_is_not_poisoned_by_fake_tensors():
    # A constructor run under FakeTensorMode (export, fake tracing, a memory estimator) must
    # not leave FakeTensors in the per-layout index cache for later real calls (the csr/bsr
    # backends read the same cache); the same holds for fake CUDA tensors.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from blockdiag.construct import block_diag_coo, block_diag_mask
    from blockdiag.layout import BlockLayout

    lay = BlockLayout(3, 5, 7)
    with FakeTensorMode():
        assert isinstance(lay.csr_indices(torch.device("cpu"))[0], FakeTensor)
        assert isinstance(lay.coo_indices(torch.device("cpu")), FakeTensor)
        assert isinstance(block_diag_mask(3, (5, 7)), FakeTensor)
    for t in (*lay.csr_indices(torch.device("cpu")), lay.coo_indices(torch.device("cpu")), lay.mask(torch.device("cpu"))):
        assert type(t) is torch.Tensor
    w = torch.randn(3, 5, 7)
    torch.testing.assert_close(block_diag_coo(w).to_dense(), torch.block_diag(*w))
    x = torch.randn(4, 21)
    torch.testing.assert_close(blockdiag.grouped_linear(x, w, backend="csr"), x @ torch.block_diag(*w).T)


def test_to_blocks_and_block_diag_mask_keep_no_matrix_sized_mask():
    # The mask has an entry per entry of the full [G*r, G*c] matrix: cached per shape, each
    # to_blocks of a dense matrix (and each block_diag_mask) held one for the process's life.
    import gc

    def bool_tensors(shape):
        gc.collect()
        return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.dtype == torch.bool
                and tuple(t.shape) == shape]

    shape = (3 * 5, 3 * 7)
    before = len(bool_tensors(shape))
    w = torch.randn(3, 5, 7)
    torch.testing.assert_close(blockdiag.to_blocks(blockdiag.block_diag_dense(w), 3), w)
    torch.testing.assert_close(blockdiag.to_blocks(blockdiag.block_diag_dense(w.transpose(1, 2)).t(), 3), w)
    mask = blockdiag.block_diag_mask(3, (5, 7))
    assert mask.sum() == 3 * 5 * 7
    del mask
    assert len(bool_tensors(shape)) == before
    with pytest.raises(BlockDiagError, match=r"non-zero 1\.0 at \(0, 7\)"):
        m = blockdiag.block_diag_dense(w)
        m[0, 7] = 1.0
        blockdiag.to_blocks(m, 3)


def test_csr_index_cache_holds_int32_and_no_returned_matrix_indices():
    # The column index has one entry per stored weight entry: cached in int64 (torch's default)
    # for every shape the csr backend ran, it cost twice a float32 weight's bytes for the life
    # of the process, and each block_diag_csr added its shape's indices to the cache too.
    from blockdiag.layout import _csr_indices

    _csr_indices.cache_clear()
    m = blockdiag.block_diag_csr(torch.randn(3, 4, 5))
    assert (m.crow_indices().dtype, m.col_indices().dtype) == (torch.int64, torch.int64)
    assert _csr_indices.cache_info().currsize == 0  # built for the caller, not cached
    x, w, b = (torch.randn(6, 15, requires_grad=True), torch.randn(3, 4, 5, requires_grad=True),
               torch.randn(12, requires_grad=True))
    got = blockdiag.grouped_linear(x, w, b, backend="csr")
    want = blockdiag.testing.reference_loop(x, w, b)
    gy = torch.randn_like(want)
    for a, c in zip((got, *torch.autograd.grad(got, (x, w, b), gy)), (want, *torch.autograd.grad(want, (x, w, b), gy))):
        torch.testing.assert_close(a, c)
    cached = _csr_indices.cache_info().currsize
    assert cached == 2  # the blocks and their transposes (the input gradient)
    for crow, col in (_csr_indices(3, 4, 5, torch.device("cpu"), torch.int32),
                      _csr_indices(3, 5, 4, torch.device("cpu"), torch.int32)):
        assert crow.dtype == col.dtype == torch.int32
    assert _csr_indices.cache_info().currsize == cached  # those were the entries the products made
    with pytest.raises(ValueError, match=r"int32 CSR indices cannot count 4294967296 stored entries"):
        blockdiag.layout.BlockLayout(2**16, 2**8, 2**8).csr_indices(torch.device("cpu"), torch.int32)


@pytest.mark.parametrize("build", ["coo", "bsr", "bsr_1x1", "from_scipy_coo"])
def test_sparse_builders_leave_no_indices_in_the_layout_cache(build):
    # The matrix handed back owns its indices; block_diag_coo took them from the layout's
    # cache and cloned them, leaving the cached COO indices and the int64 CSR ones they were
    # built from (24 bytes per stored entry, six times a float32 weight) for the life of the
    # process, as block_diag_bsr left its indices (one per stored entry with blocksize (1, 1)).
    from blockdiag.layout import _coo_indices, _csr_indices

    w = torch.randn(3, 4, 6)
    want = blockdiag.block_diag_dense(w)
    _csr_indices.cache_clear()
    _coo_indices.cache_clear()
    if build == "coo":
        m = blockdiag.block_diag_coo(w)
    elif build == "bsr":
        m = blockdiag.block_diag_bsr(w)
    elif build == "bsr_1x1":
        m = blockdiag.block_diag_bsr(w, (1, 1))
    else:
        pytest.importorskip("scipy")
        m = blockdiag.from_scipy(blockdiag.to_scipy(want), 3, layout="coo")
    assert (_csr_indices.cache_info().currsize, _coo_indices.cache_info().currsize) == (0, 0)
    torch.testing.assert_close(m.to_dense(), want)
    if build == "coo":
        assert m.is_coalesced() and m.indices().dtype == torch.int64
        assert m.values().data_ptr() == w.data_ptr()
    elif build != "from_scipy_coo":
        assert m.crow_indices().dtype == m.col_indices().dtype == torch.int64
        m.col_indices().zero_()  # the matrix's own: the next one is not changed
        torch.testing.assert_close(blockdiag.block_diag_bsr(w, (1, 1) if build == "bsr_1x1" else None).to_dense(), want)
    # The products still cache what they run with (their indices are shared by every call).
    blockdiag.grouped_linear(torch.randn(2, 18), w, backend="bsr")
    assert _csr_indices.cache_info().currsize == 1


@pytest.mark.parametrize("layout", ["csr", "bsr", "coo", "csc"])
def test_to_scipy_shares_no_memory_with_the_matrix_or_blocks(layout):
    # scipy's in-place methods on the result must not rewrite the blocks or corrupt the matrix.
    w = torch.tensor([[[1.0, 0.0], [2.0, 3.0]], [[4.0, 5.0], [0.0, 6.0]]])
    orig = w.clone()
    m = block_diag_csr(w).to_sparse_csc() if layout == "csc" else BUILDERS[layout][0](w)
    s = to_scipy(m)
    s *= 10
    if layout != "coo":  # compacts data and indices in place
        s.eliminate_zeros()
    assert torch.equal(w, orig)
    assert torch.equal(m.to_dense(), _scipy_dense(orig).float())
    if layout == "csr":
        torch._validate_sparse_csr_tensor_args(m.crow_indices(), m.col_indices(), m.values(), m.shape)


@pytest.mark.parametrize("build", ["dense", "csr", "bsr", "coo"])
@pytest.mark.parametrize(
    "blocks, match",
    [
        (lambda: torch.ones(2, 2, 3).to_sparse(), r"blocks is a sparse_coo tensor of shape \(2, 2, 3\).*blocks.to_dense\(\)"),
        (lambda: [torch.ones(2, 3), torch.ones(2, 3).to_sparse_csr()], r"blocks\[1\] is a sparse_csr tensor of shape \(2, 3\)"),
        (lambda: [torch.ones(2, 3).to_sparse(), torch.ones(2, 3).to_sparse()], r"blocks\[0\] is a sparse_coo tensor"),
        (lambda: torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(2, 3)]), r"blocks is a nested tensor"),
    ],
)
def test_builders_name_sparse_and_nested_blocks(build, blocks, match):
    with pytest.raises(BlockDiagError, match=rf"block_diag_{build}: {match}"):
        BUILDERS[build][0](blocks())


@pytest.mark.parametrize("shape, groups", [((12, 0), 3), ((0, 6), 2), ((0, 0), 1)])
@pytest.mark.parametrize("kind", ["dense", "coo", "scipy"])
def test_to_blocks_names_an_empty_side_not_the_divisibility(shape, groups, kind):
    # groups divides 0: saying that it must divide the shape contradicted the shape shown.
    m = torch.zeros(shape)
    m = {"dense": m, "coo": m.to_sparse(), "scipy": sp.csr_array(m.numpy())}[kind]
    with pytest.raises(BlockDiagError, match=rf"to_blocks: matrix of shape \({shape[0]}, {shape[1]}\) has an empty side") as e:
        to_blocks(m, groups)
    assert "must divide" not in str(e.value)


FROM_SCIPY_REFUSALS = [
    ("from_scipy-spmatrix=None", lambda: from_scipy(None, 2),
     r"^from_scipy: spmatrix must be a torch tensor or a scipy sparse matrix, got NoneType"),
    ("from_scipy-spmatrix=ndarray", lambda: from_scipy(np.eye(4), 2), r"^from_scipy: spmatrix must be .*got ndarray"),
    ("from_scipy-spmatrix=off-diagonal", lambda: from_scipy(sp.csr_array(np.ones((4, 4))), 2),
     r"^from_scipy: spmatrix of shape \(4, 4\) has a non-zero 1\.0 at \(0, 2\), outside the 2 diagonal blocks"),
    ("from_scipy-spmatrix=empty-side", lambda: from_scipy(sp.csr_array((0, 4)), 2),
     r"^from_scipy: spmatrix of shape \(0, 4\) has an empty side"),
    ("from_scipy-groups=3", lambda: from_scipy(sp.eye(4, format="csr"), 3),
     r"^from_scipy: groups=3 must divide both dimensions of spmatrix \(shape \(4, 4\)\)"),
    ("from_scipy-groups=None", lambda: from_scipy(sp.eye(4, format="csr"), None),
     r"^from_scipy: groups must be a positive int, got None"),
]


@pytest.mark.parametrize("call,pattern", [c[1:] for c in FROM_SCIPY_REFUSALS], ids=[c[0] for c in FROM_SCIPY_REFUSALS])
def test_from_scipy_names_its_own_arguments(call, pattern):
    # The refusals came from the to_blocks it calls, as "to_blocks: matrix ...": a function and
    # an argument (matrix) the caller never named.
    with pytest.raises(BlockDiagError, match=pattern):
        call()
