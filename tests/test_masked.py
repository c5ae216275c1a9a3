"""Masked gradient updates: off-diagonal entries of a masked ``nn.Linear`` stay exactly 0.0."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from blockdiag import BlockDiagError, block_diag_mask, mask_block_diagonal_, remove_block_diagonal_mask_

from _params import CUDA, DEVICES


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-decay": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.5),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
}


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("device", DEVICES)
def test_offdiagonal_stays_exactly_zero(device, opt, clip):
    g, r, c = 3, 4, 5
    lin = mask_block_diagonal_(nn.Linear(g * c, g * r, device=device), g)
    off = ~block_diag_mask(g, (r, c), device=device)
    optim = OPTIMIZERS[opt](lin.parameters())
    x = torch.randn(16, g * c, device=device)
    target = torch.randn(16, g * r, device=device)
    assert bool((lin.weight[off] == 0.0).all())
    for _ in range(20):
        optim.zero_grad()
        # a loss that would pull every entry (diagonal or not) away from zero
        loss = ((lin(x) - target) ** 2).mean() + lin.weight.sum()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(lin.parameters(), 0.1)
        optim.step()
        w = lin.weight
        assert bool((w[off] == 0.0).all()), f"{opt}: off-diagonal drifted to {w[off].abs().max()}"
        assert bool((w[~off] != 0.0).any())
        # the optimizer's own tensor also holds zeros there (weight decay cannot revive them)
        assert bool((lin.parametrizations.weight.original[off] == 0.0).all())


def test_masked_equals_grouped_reference():
    lin = mask_block_diagonal_(nn.Linear(6, 4), 2)
    x = torch.randn(3, 6)
    w = lin.weight.detach()
    want = torch.cat([x[:, :3] @ w[:2, :3].T, x[:, 3:] @ w[2:, 3:].T], -1) + lin.bias.detach()
    torch.testing.assert_close(lin(x), want)


def test_weight_assignment_is_masked():
    lin = mask_block_diagonal_(nn.Linear(4, 4), 2)
    lin.weight = torch.ones(4, 4)
    assert lin.weight.sum().item() == 8.0


def test_state_dict_plain_key_and_loads_into_unmasked_linear():
    lin = mask_block_diagonal_(nn.Linear(4, 6), 2)
    sd = lin.state_dict()
    assert set(sd) == {"weight", "bias"}
    plain = nn.Linear(4, 6)
    plain.load_state_dict(sd)
    torch.testing.assert_close(plain.weight, lin.weight)
    other = mask_block_diagonal_(nn.Linear(4, 6), 2)
    other.load_state_dict(sd)
    torch.testing.assert_close(other.weight, lin.weight)


def test_load_state_dict_with_offdiagonal_nonzero_is_refused():
    lin = mask_block_diagonal_(nn.Linear(4, 6), 2)
    before = lin.weight.detach().clone()
    sd = nn.Linear(4, 6).state_dict()  # dense: non-zeros everywhere
    with pytest.raises(BlockDiagError, match=r"weight of shape \(6, 4\) has a non-zero .* at \(0, 2\), outside the 2 diagonal blocks of shape \(3, 2\)"):
        lin.load_state_dict(sd)
    torch.testing.assert_close(lin.weight, before)


def test_nested_module_prefix():
    model = nn.Sequential(nn.Linear(4, 4), mask_block_diagonal_(nn.Linear(4, 4), 4))
    sd = model.state_dict()
    assert "1.weight" in sd
    sd["1.weight"][0, 1] = 3.0
    with pytest.raises(BlockDiagError, match=r"1\.weight .* at \(0, 1\)"):
        model.load_state_dict(sd)


def test_remove_restores_plain_parameter():
    lin = mask_block_diagonal_(nn.Linear(4, 4), 2)
    w = lin.weight.detach().clone()
    remove_block_diagonal_mask_(lin)
    assert type(lin.weight) is nn.Parameter
    torch.testing.assert_close(lin.weight.detach(), w)
    assert set(lin.state_dict()) == {"weight", "bias"}
    lin.load_state_dict(nn.Linear(4, 4).state_dict())  # hooks removed: dense loads again
    with pytest.raises(BlockDiagError, match="has no block-diagonal mask"):
        remove_block_diagonal_mask_(lin)


@pytest.mark.parametrize(
    "module, groups, match",
    [
        (nn.Linear(6, 4), 4, r"groups=4 must divide"),
        (nn.Conv1d(2, 2, 1), 1, r"weight must be 2-D, got shape \(2, 2, 1\)"),
        (nn.ReLU(), 1, r"has no weight tensor"),
        (mask_block_diagonal_(nn.Linear(4, 4), 2), 2, r"already parametrized"),
    ],
    ids=["not-dividing", "3d-weight", "no-weight", "twice"],
)
def test_bad_input(module, groups, match):
    with pytest.raises(BlockDiagError, match=match):
        mask_block_diagonal_(module, groups)


@pytest.mark.skipif(not CUDA, reason="CUDA is not available")
@pytest.mark.cuda
def test_mask_follows_module_to_device():
    lin = mask_block_diagonal_(nn.Linear(4, 4), 2).to("cuda")
    assert lin.weight.device.type == "cuda"
    assert lin(torch.randn(2, 4, device="cuda")).shape == (2, 4)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_input_does_not_poison_other_blocks(device, bad):
    # One non-finite input column of block 1 makes that column's gradient non-finite in
    # every row; off the diagonal it must still be exactly zero, and block 0, which never
    # reads that column, must keep computing finite outputs afterwards.
    g = 2
    lin = mask_block_diagonal_(nn.Linear(4, 6, device=device), g)
    off = ~block_diag_mask(g, (3, 2), device=device)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(5, 4, device=device)
    x[0, 3] = bad
    lin(x).sum().backward()
    opt.step()
    orig = lin.parametrizations.weight.original
    assert bool((orig[off] == 0.0).all()) and bool((lin.weight[off] == 0.0).all())
    y = lin(torch.randn(2, 4, device=device))
    assert bool(torch.isfinite(y[:, :3]).all())
    lin.load_state_dict(lin.state_dict())  # its own checkpoint loads again


# --- meta-device initialisation (issue 22, item 7) ------------------------------------------
# Build under torch.device("meta"), mask, to_empty(device=...), then reset_parameters() or load
# a checkpoint. `to_empty` leaves every tensor it re-creates uninitialised: `poisoned` makes
# that memory deterministic and hostile (bool tensors all True, floats 2.5 or NaN), so a mask
# kept in such a tensor fails every time, not only when the allocator hands out dirty pages.

G, R, C = 4, 2, 3  # 4 blocks of 2 (out) x 3 (in): weight [8, 12]


@pytest.fixture(params=["real", "poisoned-2.5", "poisoned-nan"])
def to_empty_memory(request, monkeypatch):
    if request.param != "real":
        fill = 2.5 if request.param == "poisoned-2.5" else float("nan")
        real = torch.empty_like

        def poisoned(t, *args, **kwargs):
            out = real(t, *args, **kwargs)
            return out.fill_(True) if out.dtype == torch.bool else out.fill_(fill)

        monkeypatch.setattr(torch, "empty_like", poisoned)  # what nn.Module.to_empty calls
    return request.param


def _meta_masked(device="cpu"):
    with torch.device("meta"):
        lin = mask_block_diagonal_(nn.Linear(G * C, G * R), G)
    assert lin.weight.device.type == "meta"
    return lin.to_empty(device=device)


def _reference(seed):
    torch.manual_seed(seed)
    return mask_block_diagonal_(nn.Linear(G * C, G * R), G)  # __init__ draws the same numbers


OFF = ~block_diag_mask(G, (R, C))


def _assert_block_diagonal(lin):
    assert bool((lin.weight[OFF] == 0.0).all()), f"off-diagonal reached {lin.weight[OFF].abs().max()}"
    assert bool((lin.parametrizations.weight.original[OFF] == 0.0).all())


def test_meta_init_then_reset_parameters_is_a_masked_fresh_linear(to_empty_memory):
    lin = _meta_masked()
    # Before any initialisation `original` is uninitialised memory, but `weight` is already
    # exactly zero off the diagonal (the mask selects; NaN there does not leak).
    assert bool((lin.weight[OFF] == 0.0).all())
    torch.manual_seed(0)
    lin.reset_parameters()
    _assert_block_diagonal(lin)
    ref = _reference(0)
    # reset_parameters reached `original` (not a temporary copy of `weight`): the same
    # numbers as a masked nn.Linear built on the CPU from the same seed, bit for bit.
    assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.bias, ref.bias)
    assert bool(torch.isfinite(lin(torch.randn(5, G * C))).all())


def test_meta_init_then_load_state_dict_of_a_block_diagonal_checkpoint(to_empty_memory):
    ref = _reference(1)
    lin = _meta_masked()
    lin.load_state_dict(ref.state_dict())  # a genuine block-diagonal checkpoint: accepted
    assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.bias, ref.bias)
    _assert_block_diagonal(lin)
    # ... also when it comes from a plain nn.Linear whose weight is block-diagonal.
    plain = nn.Linear(G * C, G * R)
    with torch.no_grad():
        plain.weight.masked_fill_(OFF, 0.0)
    lin.load_state_dict(plain.state_dict())
    assert torch.equal(lin.weight, plain.weight)
    # A checkpoint with one off-diagonal non-zero is still refused, and names the entry.
    sd = plain.state_dict()
    sd["weight"][0, 5] = 0.25
    with pytest.raises(BlockDiagError, match=r"non-zero 0\.25 at \(0, 5\)"):
        lin.load_state_dict(sd)


def test_meta_init_then_load_state_dict_assign():
    ref = _reference(2)
    with torch.device("meta"):
        lin = mask_block_diagonal_(nn.Linear(G * C, G * R), G)
    lin.load_state_dict(ref.state_dict(), assign=True)  # the meta tensors are replaced
    assert lin.weight.device.type == "cpu"
    assert torch.equal(lin.weight, ref.weight)
    _assert_block_diagonal(lin)


@pytest.mark.parametrize("opt", ["sgd-momentum", "adam", "adamw-decay"])
def test_meta_init_then_training_keeps_offdiagonal_exactly_zero(to_empty_memory, opt):
    lin = _meta_masked()
    torch.manual_seed(3)
    lin.reset_parameters()
    ref = _reference(3)
    x, target = torch.randn(16, G * C), torch.randn(16, G * R)
    for model in (lin, ref):
        optim = OPTIMIZERS[opt](model.parameters())
        for _ in range(10):
            optim.zero_grad()
            # a loss that would pull every entry (diagonal or not) away from zero
            (((model(x) - target) ** 2).mean() + model.weight.sum()).backward()
            optim.step()
            _assert_block_diagonal(model)
    # the meta-initialised layer trains exactly as one built normally
    assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.bias, ref.bias)


def test_mask_is_derived_not_stored():
    lin = mask_block_diagonal_(nn.Linear(G * C, G * R), G)
    # Nothing for to_empty, load_state_dict or a device move to leave stale or uninitialised.
    assert dict(lin.named_buffers()) == {}
    assert set(lin.state_dict()) == {"weight", "bias"}
    assert torch.equal(lin.parametrizations.weight[0].mask, ~OFF)
    assert lin.parametrizations.weight[0].mask_on("meta").shape == OFF.shape


def test_mask_first_built_under_inference_mode_still_trains():
    # The first CPU forward after to_empty runs under inference mode (serving warm-up): the
    # cached mask must be a normal tensor, or the next training step could not save it.
    lin = _meta_masked()
    lin.parametrizations.weight[0]._masks.clear()
    with torch.inference_mode():
        lin(torch.randn(2, G * C))
    lin(torch.randn(2, G * C)).sum().backward()
    assert bool((lin.parametrizations.weight.original.grad[OFF] == 0.0).all())


def test_reset_parameters_of_a_copy_and_after_removal():
    import copy

    lin = _reference(4)
    twin = copy.deepcopy(lin)
    before = lin.weight.detach().clone()
    twin.reset_parameters()  # resets the copy, masked, and leaves the original alone
    assert torch.equal(lin.weight, before) and not torch.equal(twin.weight, before)
    _assert_block_diagonal(twin)
    remove_block_diagonal_mask_(twin)
    twin.reset_parameters()  # a plain nn.Linear again: dense initialisation
    assert bool((twin.weight[OFF] != 0.0).all())
