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
