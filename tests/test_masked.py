"""Masked gradient updates: off-diagonal entries of a masked ``nn.Linear`` stay exactly 0.0."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune

from blockdiag import BlockDiagError, block_diag_mask, mask_block_diagonal_, remove_block_diagonal_mask_

from _params import CUDA, DEVICES


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-decay": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.5),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    # The multi-tensor and fused kernels update every parameter in one call, not through
    # the per-tensor loop: the claim is "whatever the optimizer", so they are held to it too.
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-foreach-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.5, amsgrad=True, foreach=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, fused=True),
    "adagrad-decay": lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.3, initial_accumulator_value=0.1),
    "rmsprop-centered-decay": lambda p: torch.optim.RMSprop(p, lr=1e-2, weight_decay=0.3, centered=True),
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
        (nn.Linear(4, 6), 4, r"groups=4 must divide in_features=4 and out_features=6"),
        (nn.Conv1d(2, 2, 1), 1, r"weight must be 2-D, got shape \(2, 2, 1\)"),
        (nn.ReLU(), 1, r"has no weight tensor"),
        (mask_block_diagonal_(nn.Linear(4, 4), 2), 2, r"already masked"),
        (nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)), 2,
         r"already parametrized \(_SpectralNorm\): mask it first"),
        # torch cannot stack these on the mask (registered there, every forward raised a TypeError)
        (nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), 2,
         r"already parametrized \(_WeightNorm\), by one that torch runs only as the first"),
        (nn.utils.parametrizations.orthogonal(nn.Linear(4, 4)), 2,
         r"already parametrized \(_Orthogonal\), by one that torch runs only as the first"),
        (nn.LazyLinear(4), 2, r"not initialised yet \(LazyLinear is lazy\)"),
    ],
    ids=["not-dividing", "not-dividing-out", "3d-weight", "no-weight", "twice", "other-parametrization",
         "weight-norm", "orthogonal", "lazy"],
)
def test_bad_input(module, groups, match):
    with pytest.raises(BlockDiagError, match=match):
        mask_block_diagonal_(module, groups)


def _hooked(apply):
    lin = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old weight_norm announces its deprecation
        apply(lin)
    return lin


@pytest.mark.parametrize(
    "apply, held",
    [
        (lambda lin: prune.l1_unstructured(lin, "weight", 0.5), "bias, weight_orig, weight_mask"),
        (lambda lin: nn.utils.weight_norm(lin), "bias, weight_g, weight_v"),
        (lambda lin: nn.utils.spectral_norm(lin), "bias, weight_orig, weight_u, weight_v"),
    ],
    ids=["prune", "old-weight_norm", "old-spectral_norm"],
)
def test_a_weight_recomputed_by_a_hook_is_refused_saying_so(apply, held):
    # linear.weight is there (a tensor that the hook recomputes), only not as a parameter:
    # torch's own refusal claimed the module had no 'weight'.
    lin = _hooked(apply)
    assert isinstance(lin.weight, torch.Tensor)
    with pytest.raises(BlockDiagError, match=rf"neither a parameter nor a buffer of the Linear \(it holds {held}\)"
                                             r".*remove that first"):
        mask_block_diagonal_(lin, 2)


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



def test_a_non_finite_input_reaches_every_block_of_the_row_as_the_faq_says():
    # docs/faq.md ("A NaN in one head shows up in other heads"): a masked nn.Linear multiplies
    # the whole dense matrix, so 0 * NaN reaches the other blocks' outputs and, through a loss
    # over every output, their weights; while the mask keeps the off-diagonal exactly zero.
    lin = mask_block_diagonal_(nn.Linear(4, 6), 2)
    off = ~block_diag_mask(2, (3, 2))
    x = torch.randn(5, 4)
    x[0, 3] = float("nan")  # read by block 1 only
    y = lin(x)
    assert bool(y[0, :3].isnan().all()) and bool(torch.isfinite(y[1:]).all())
    ((y - torch.randn(5, 6)) ** 2).mean().backward()
    torch.optim.SGD(lin.parameters(), lr=0.1).step()
    assert bool(lin.weight[:3, :2].isnan().any())  # block 0 never read the NaN
    assert bool((lin.weight[off] == 0.0).all())

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


def test_reset_parameters_of_a_module_whose_class_derives_from_the_masked_one():
    # FSDP2's fully_shard(lin) does this: lin's class becomes FSDP<ParametrizedLinear>, which
    # inherits the masked reset_parameters (it recursed without end; tests/test_distributed.py
    # runs fully_shard itself).
    torch.manual_seed(0)
    lin = mask_block_diagonal_(nn.Linear(8, 6), 2)
    lin.__class__ = type("Derived" + type(lin).__name__, (type(lin),), {})
    with torch.no_grad():
        lin.parametrizations.weight.original.fill_(7.0)  # as to_empty would leave it: garbage
    torch.manual_seed(1)
    lin.reset_parameters()
    ref = mask_block_diagonal_(nn.Linear(8, 6), 2)
    torch.manual_seed(1)
    ref.reset_parameters()
    assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.bias, ref.bias)
    assert bool((lin.parametrizations.weight.original[~block_diag_mask(2, (3, 4))] == 0.0).all())


# --- copies, stacked parametrizations, checkpoints' key names ---------------------------------


def test_state_dict_loads_in_place_as_torch_distributed_checkpoint_does(tmp_path):
    # dcp.load writes into the tensors of the state dict it is given (its guide's pattern:
    # dcp.load(model.state_dict(), ...)); the weight entry must be the parameter's storage,
    # not a masked copy whose loaded values are then dropped while the bias loads.
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    src = _reference(0)
    dcp.save({"model": src.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    dst = _reference(1)
    dcp.load({"model": dst.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    torch.testing.assert_close(dst.weight, src.weight, rtol=0, atol=0)
    torch.testing.assert_close(dst.bias, src.bias, rtol=0, atol=0)
    _assert_block_diagonal(dst)
    # The entry is a detached value over original's storage, not the parameter itself.
    sd = dst.state_dict(keep_vars=True)
    assert sd["weight"].grad_fn is None and not sd["weight"].requires_grad
    assert sd["weight"].data_ptr() == dst.parametrizations.weight.original.data_ptr()


def _nan_step(lin):
    # One NaN input: clip_grad_norm_'s factor is NaN and multiplies the exact zero gradients
    # off the blocks, so the step writes NaN into original there (the weight stays masked).
    optim = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, G * C)
    x[0, 0] = float("nan")
    lin(x).sum().backward()
    torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0)
    optim.step()


def _resumed_step(lin):
    # An optimizer state resumed from an unmasked run (same parameter order) steps the
    # entries off the blocks, gradient zero or not.
    plain = nn.Linear(G * C, G * R)
    done = torch.optim.SGD([plain.weight, plain.bias], lr=0.1, momentum=0.9)
    plain(torch.randn(4, G * C)).sum().backward()
    done.step()
    optim = torch.optim.SGD([lin.parametrizations.weight.original, lin.bias], lr=0.1, momentum=0.9)
    optim.load_state_dict(done.state_dict())
    lin(torch.randn(4, G * C)).sum().backward()
    optim.step()


@pytest.mark.parametrize("step", [_nan_step, _resumed_step], ids=["nan-clipped", "resumed-optimizer"])
def test_state_dict_loads_in_place_after_original_got_values_off_the_blocks(tmp_path, step):
    # A rollback with dcp.load(model.state_dict(), ...) after such a step: the weight entry
    # was a masked copy (original was not zero off the blocks), dcp wrote the checkpoint
    # into the copy, and the module kept the diverged weights, silently.
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    lin = _reference(0)
    good = {k: v.clone() for k, v in lin.state_dict().items()}
    dcp.save({"model": lin.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    step(lin)
    assert bool((lin.weight[OFF] == 0.0).all())
    assert not bool((lin.parametrizations.weight.original[OFF] == 0.0).all())  # the premise
    before = lin(torch.ones(2, G * C))
    sd = lin.state_dict()
    # Clearing original's off-block entries changed nothing the module computes.
    torch.testing.assert_close(lin(torch.ones(2, G * C)), before, rtol=0, atol=0, equal_nan=True)
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path), no_dist=True)
    torch.testing.assert_close(lin.weight, good["weight"], rtol=0, atol=0)
    torch.testing.assert_close(lin.bias, good["bias"], rtol=0, atol=0)
    assert sd["weight"].data_ptr() == lin.parametrizations.weight.original.data_ptr()
    _assert_block_diagonal(lin)


def test_state_dict_inside_functional_call_copies_and_leaves_the_tensor_passed_alone():
    # The tensor functional_call puts in original's place is the caller's: state_dict() taken
    # inside the call masks a copy rather than writing into it.
    from torch.func import functional_call

    lin = _reference(0)
    t = torch.ones(G * R, G * C)
    seen = {}

    def pre(module, args):
        seen.update(module.state_dict())

    lin.register_forward_pre_hook(pre)
    functional_call(lin, {"parametrizations.weight.original": t}, (torch.randn(2, G * C),))
    assert bool((t == 1.0).all())
    torch.testing.assert_close(seen["weight"], torch.where(~OFF, t, 0), rtol=0, atol=0)


def test_state_dict_loads_in_place_after_original_got_off_block_values(tmp_path):
    # DDP's PowerSGD hook steps `original` with a low-rank gradient that is non-zero off the
    # blocks (tests/test_distributed.py trains one so); the state dict's entry was then a
    # masked copy, so dcp.load(model.state_dict()) loaded the bias and silently not the weight.
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    src = _reference(0)
    dcp.save({"model": src.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    dst = _reference(1)
    orig = dst.parametrizations.weight.original
    with torch.no_grad():
        orig[OFF] = torch.linspace(-1.0, 1.0, int(OFF.sum()))
        orig[0, -1] = float("nan")
    before = dst.weight.detach().clone()
    sd = dst.state_dict()
    # Nothing that forward computes changed; only the entries the mask selects away are zeroed.
    torch.testing.assert_close(dst.weight, before, rtol=0, atol=0)
    assert sd["weight"].data_ptr() == orig.data_ptr()
    _assert_block_diagonal(dst)
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path), no_dist=True)
    torch.testing.assert_close(dst.weight, src.weight, rtol=0, atol=0)
    torch.testing.assert_close(dst.bias, src.bias, rtol=0, atol=0)


class _Scale2(nn.Module):
    """A second parametrization stacked on the mask (a user's reparametrization)."""

    def forward(self, w):
        return 2 * w


def _stacked(seed):
    lin = _reference(seed)
    nn.utils.parametrize.register_parametrization(lin, "weight", _Scale2())
    return lin


@pytest.mark.parametrize("which", ["copy", "original", "averaged"])
def test_removing_the_mask_from_one_copy_leaves_the_other_masked(which):
    import copy

    lin = _reference(0)
    twin = torch.optim.swa_utils.AveragedModel(lin).module if which == "averaged" else copy.deepcopy(lin)
    assert type(twin) is type(lin)  # torch shares the parametrized class between copies
    removed, kept = (lin, twin) if which == "original" else (twin, lin)
    remove_block_diagonal_mask_(removed)
    x = torch.randn(3, G * C)
    assert kept(x).shape == (3, G * R) and removed(x).shape == (3, G * R)
    assert nn.utils.parametrize.is_parametrized(kept, "weight")
    kept.parametrizations.weight.original.data.fill_(1.0)
    assert bool((kept.weight[OFF] == 0.0).all())
    assert type(removed.weight) is nn.Parameter


@pytest.mark.parametrize("which", ["copy", "averaged"])
def test_a_copy_of_a_compiled_masked_module_runs_its_own_weights(which):
    # torch's parametrized class deep-copies __dict__ whole, model.compile()'s wrapper of the
    # original's _call_impl included: the copy (AveragedModel's too) ran the original's weights.
    import copy

    lin = _reference(0)
    lin.compile(backend="eager")
    twin = torch.optim.swa_utils.AveragedModel(lin).module if which == "averaged" else copy.deepcopy(lin)
    with torch.no_grad():
        twin.parametrizations.weight.original.zero_()
        twin.bias.zero_()
        assert torch.equal(twin(torch.randn(3, G * C)), torch.zeros(3, G * R))
    remove_block_diagonal_mask_(twin)
    mask_block_diagonal_(twin, G)  # masked again: its copies are its own too
    assert torch.equal(copy.deepcopy(twin)(torch.ones(1, G * C)), torch.zeros(1, G * R))


def test_with_a_parametrization_stacked_on_the_mask_the_checkpoint_keeps_torchs_keys():
    lin, other = _stacked(0), _stacked(1)
    sd = lin.state_dict()
    # The masked original alone is not the weight the module computes (2x here): a plain
    # "weight" key would load into nn.Linear as another model.
    assert set(sd) == {"bias", "parametrizations.weight.original"}
    other.load_state_dict(sd)
    x = torch.randn(3, G * C)
    torch.testing.assert_close(other(x), lin(x), rtol=0, atol=0)


def test_removing_the_mask_keeps_the_parametrizations_stacked_on_it():
    lin = _stacked(0)
    before = lin.weight.detach().clone()
    remove_block_diagonal_mask_(lin)
    assert [type(p).__name__ for p in lin.parametrizations.weight] == ["_Scale2"]
    torch.testing.assert_close(lin.weight, before, rtol=0, atol=0)
    lin.parametrizations.weight.original.data.fill_(1.0)  # no longer masked: it may drift
    assert bool((lin.weight[OFF] == 2.0).all())


def test_reset_parameters_initialises_original_under_a_stacked_parametrization():
    with torch.device("meta"):
        lin = mask_block_diagonal_(nn.Linear(G * C, G * R), G)
    nn.utils.parametrizations.spectral_norm(lin)
    lin.to_empty(device="cpu")
    lin.parametrizations.weight.original.data.fill_(float("nan"))
    lin.reset_parameters()
    orig = lin.parametrizations.weight.original
    bound = 1 / (G * C) ** 0.5  # nn.Linear's kaiming_uniform_(a=sqrt(5)) over fan_in = G * C
    assert bool(orig.isfinite().all()) and float(orig.abs().max()) <= bound
    assert bool((orig[OFF] == 0.0).all()) and bool((orig[~OFF] != 0.0).all())
    assert [type(p).__name__ for p in lin.parametrizations.weight] == ["BlockDiagonalMask", "_SpectralNorm"]


def test_load_state_dict_names_weight_not_the_internal_key():
    lin = _reference(0)
    r = lin.load_state_dict({"bias": torch.zeros(G * R)}, strict=False)
    assert r.missing_keys == ["weight"] and r.unexpected_keys == []
    with pytest.raises(RuntimeError) as e:
        lin.load_state_dict({"weight": torch.zeros(G * R, G * R), "bias": torch.zeros(G * R)})
    msg = str(e.value)
    assert "size mismatch for weight: copying a param with shape torch.Size([8, 8])" in msg, msg
    assert "parametrizations" not in msg, msg
    # The mismatch is the one error, as on a plain nn.Linear: not "weight" missing as well.
    assert "Missing key(s)" not in msg, msg
    outer = nn.Sequential(nn.Identity(), _reference(0))
    r = outer.load_state_dict({"1.bias": torch.zeros(G * R)}, strict=False)
    assert r.missing_keys == ["1.weight"]


# assign=True takes a meta entry as it takes any tensor (the meta-device flow): not an error.
@pytest.mark.parametrize("entry, assign", [(e, a) for e in ("sparse_coo", "sparse_csr", "numpy")
                                           for a in (False, True)] + [("meta", False)])
def test_load_state_dict_of_a_sparse_non_tensor_or_meta_weight_names_the_key(entry, assign):
    # A block-diagonal weight is naturally saved sparse; loading such an entry failed inside
    # the mask's block check with torch's NotImplementedError ("aten::ne.Scalar ... SparseCPU"),
    # naming no key, and torch's copy errors (a non-tensor or a meta entry) named
    # parametrizations.weight.original, a key the checkpoint does not have.
    src = _reference(0)
    w = src.state_dict()["weight"]
    value = {"sparse_coo": lambda: w.to_sparse(), "sparse_csr": lambda: w.to_sparse_csr(),
             "numpy": lambda: w.numpy(), "meta": lambda: w.to("meta")}[entry]()
    outer = nn.Sequential(nn.Identity(), _reference(1))
    before = outer[1].weight.detach().clone()
    with pytest.raises(RuntimeError) as e:
        outer.load_state_dict({"1.weight": value, "1.bias": torch.zeros(G * R)}, assign=assign)
    msg = str(e.value)
    assert 'While copying the parameter named "1.weight"' in msg and "parametrizations" not in msg, msg
    assert "Missing key(s)" not in msg, msg
    if entry.startswith("sparse"):
        assert f"torch.{entry} tensor" in msg and ".to_dense()" in msg, msg
    torch.testing.assert_close(outer[1].weight, before)
    assert outer[1].parametrizations.weight.original.layout == torch.strided
    outer.load_state_dict({"1.weight": w.to_sparse().to_dense(), "1.bias": torch.zeros(G * R)}, assign=assign)
    torch.testing.assert_close(outer[1].weight, src.weight)
    assert "_blockdiag_load_errors" not in vars(outer[1])


def test_state_dict_keep_vars_gives_a_leaf():
    import copy

    sd = _reference(0).state_dict(keep_vars=True)
    assert sd["weight"].grad_fn is None
    copy.deepcopy(sd)  # refuses non-leaf tensors


def test_the_mask_handed_out_is_a_copy():
    lin = _reference(0)
    p = lin.parametrizations.weight[0]
    p.mask.fill_(True)
    p.mask_on("cpu").fill_(True)
    lin.parametrizations.weight.original.data.fill_(1.0)
    assert bool((lin.weight[OFF] == 0.0).all())


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, (2, 2)), r"groups must be an int >= 1, got 0"),
        ((2, (2,)), r"block_shape must be two ints >= 1 \(rows, columns\), got \(2,\)"),
        ((2, (2, 0)), r"block_shape must be two ints >= 1"),
    ],
    ids=["no-groups", "one-side", "empty-side"],
)
def test_a_bad_mask_is_refused_where_it_is_made(args, match):
    from blockdiag.masked import BlockDiagonalMask

    with pytest.raises(BlockDiagError, match=match):
        BlockDiagonalMask(*args)


def test_a_mask_of_another_shape_is_refused_naming_both():
    from blockdiag.masked import BlockDiagonalMask

    with pytest.raises(BlockDiagError, match=r"weight of shape \(9, 6\) does not fit 3 blocks of shape \(2, 2\), "
                                              r"which make a weight of shape \(6, 6\)"):
        nn.utils.parametrize.register_parametrization(nn.Linear(6, 9), "weight", BlockDiagonalMask(3, (2, 2)))


def _write_every_parameter(module):
    with torch.no_grad():
        for p in module.parameters():  # includes parametrizations.weight.original
            p.fill_(1.0)


def test_state_dict_stores_the_masked_weight_even_after_original_was_written():
    lin = mask_block_diagonal_(nn.Linear(4, 6), 2)
    _write_every_parameter(lin)
    sd = lin.state_dict()
    torch.testing.assert_close(sd["weight"], lin.weight.detach(), rtol=0, atol=0)
    other = mask_block_diagonal_(nn.Linear(4, 6), 2)
    other.load_state_dict(sd)  # a checkpoint of a masked layer loads into a masked layer
    torch.testing.assert_close(other.weight, lin.weight, rtol=0, atol=0)


class _Scale2(nn.Module):
    def forward(self, w):
        return 2 * w


def test_removing_the_mask_under_a_stacked_parametrization_keeps_weight_after_original_was_written():
    lin = mask_block_diagonal_(nn.Linear(4, 6), 2)
    parametrize.register_parametrization(lin, "weight", _Scale2())
    _write_every_parameter(lin)
    before = lin.weight.detach().clone()
    remove_block_diagonal_mask_(lin)
    torch.testing.assert_close(lin.weight.detach(), before, rtol=0, atol=0)  # "weight is unchanged"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dynamo", [pytest.param(True, id="dynamo"), pytest.param(False, id="torchscript")])
def test_onnx_export_of_a_masked_linear_runs_in_onnxruntime(dynamo, tmp_path):
    # The TorchScript exporter traces with the state dict's tensors as graph inputs: the
    # masked weight there, not ``original``, made it refuse ``original`` as a constant.
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    if dynamo:
        pytest.importorskip("onnxscript")
    g, r, c = 3, 2, 4
    lin = mask_block_diagonal_(nn.Linear(g * c, g * r), g).eval()
    x = torch.randn(5, g * c)
    path = tmp_path / "masked.onnx"
    torch.onnx.export(lin, (x,), path, dynamo=dynamo)
    sess = ort.InferenceSession(str(path))
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), lin(x))
    assert sorted(lin.state_dict()) == ["bias", "weight"]  # the export left the plain keys as they were


def test_lbfgs_and_ema_keep_offdiagonal_zero():
    # LBFGS steps along its own combination of past gradients (a closure, several
    # evaluations per step); an EMA twin (AveragedModel) averages ``original`` itself.
    g, r, c = 3, 4, 5
    lin = mask_block_diagonal_(nn.Linear(g * c, g * r), g)
    off = ~block_diag_mask(g, (r, c))
    ema = torch.optim.swa_utils.AveragedModel(lin, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    optim = torch.optim.LBFGS(lin.parameters(), lr=0.5, history_size=4, max_iter=4, line_search_fn="strong_wolfe")
    x, target = torch.randn(16, g * c), torch.randn(16, g * r)

    def closure():
        optim.zero_grad(set_to_none=False)
        loss = ((lin(x) - target) ** 2).mean() + lin.weight.sum()
        loss.backward()
        return loss

    for _ in range(3):
        optim.step(closure)
        ema.update_parameters(lin)
    for w in (lin.weight, lin.parametrizations.weight.original, ema.module.weight, ema.module.state_dict()["weight"]):
        assert bool((w[off] == 0.0).all())
    assert bool((lin.weight[~off] != 0.0).any())


def test_a_mask_first_built_under_fake_tensor_mode_is_not_kept():
    # Meta-device init, then a FakeTensorMode pass (a memory estimate) before the real
    # initialisation: the mask built under the mode is a FakeTensor and must not be cached,
    # or every later real forward computes on it and returns FakeTensors, not values.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        lin = nn.Linear(6, 4)
    mask_block_diagonal_(lin, groups=2)
    lin.to_empty(device="cpu")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        lin(mode.from_tensor(torch.randn(3, 6)))
    lin.reset_parameters()
    x = torch.randn(3, 6)
    y = lin(x)
    w = lin.weight
    assert type(y) is torch.Tensor and type(w) is torch.Tensor
    assert torch.equal(w, w * block_diag_mask(2, (2, 3)))
    torch.testing.assert_close(y, x @ w.T + lin.bias)


def test_a_load_pre_hook_registered_after_masking_sees_the_plain_key():
    # A hook that renames an old checkpoint's key to `weight` (as it does on a plain
    # nn.Linear) ran after the mask's, which had already moved `weight` to the internal key:
    # "weight" was both missing and unexpected, and strict=False kept the old weight silently.
    def rename(module, state_dict, prefix, *args):
        if prefix + "w_old" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w_old")

    src = mask_block_diagonal_(nn.Linear(4, 6), 2)
    ckpt = {"w_old": src.weight.detach().clone(), "bias": src.bias.detach().clone()}
    lin = mask_block_diagonal_(nn.Linear(4, 6), 2)
    lin.register_load_state_dict_pre_hook(rename)
    lin.load_state_dict(dict(ckpt))
    assert torch.equal(lin.weight, src.weight) and torch.equal(lin.bias, src.bias)
    ckpt["w_old"][0, 3] = 0.5  # outside the blocks: still refused, not skipped
    with pytest.raises(BlockDiagError, match=r"non-zero 0\.5 at \(0, 3\)"):
        lin.load_state_dict(dict(ckpt), strict=False)
    remove_block_diagonal_mask_(lin)
    assert "_load_from_state_dict" not in type(lin).__dict__ and "state_dict" not in type(lin).__dict__
    lin.load_state_dict(dict(ckpt))  # a plain nn.Linear again: anything loads
    assert lin.weight[0, 3] == 0.5


def test_a_state_dict_hook_registered_before_masking_sees_the_plain_key():
    # The hook ran before the mask's and found the internal key: the `weight` entry it was
    # to change (here, cast for saving, as it is on a plain nn.Linear) was saved unchanged.
    def to_half(module, state_dict, prefix, local_metadata):
        for key in (prefix + "weight", prefix + "bias"):
            state_dict[key] = state_dict[key].half()

    lin = nn.Linear(4, 6)
    lin.register_state_dict_post_hook(to_half)
    mask_block_diagonal_(lin, 2)
    sd = nn.Sequential(lin).state_dict()
    assert list(sd) == ["0.bias", "0.weight"] and all(v.dtype == torch.float16 for v in sd.values())
    assert torch.equal(sd["0.weight"], lin.weight.detach().half())


def test_functional_call_with_the_plain_weight_key_trains_original_not_the_tensor_passed():
    # Pins torch's behaviour that docs/concepts.md describes (torch 2.13): functional_call
    # assigns "weight", which copies it, masked, into original, so the tensor passed gets no
    # gradient and the module's own parameter does. If torch makes the key disable the
    # parametrization, as its documentation says, this fails: update the docs then.
    from torch.func import functional_call

    lin = _reference(0)
    orig = lin.parametrizations.weight.original
    before = orig.detach().clone()
    x = torch.randn(3, G * C)
    w = torch.randn(G * R, G * C, requires_grad=True)
    y = functional_call(lin, {"weight": w}, (x,))
    torch.testing.assert_close(y, nn.functional.linear(x, torch.where(~OFF, w, 0), lin.bias), rtol=0, atol=0)
    y.sum().backward()
    assert w.grad is None and orig.grad is not None
    assert torch.equal(orig, before)  # the values come back after the call
    # The documented way: the name named_parameters() gives.
    lin.zero_grad(set_to_none=True)
    t = torch.randn(G * R, G * C, requires_grad=True)
    y = functional_call(lin, {"parametrizations.weight.original": t}, (x,))
    torch.testing.assert_close(y, nn.functional.linear(x, torch.where(~OFF, t, 0), lin.bias), rtol=0, atol=0)
    y.sum().backward()
    assert orig.grad is None and bool((t.grad[OFF] == 0.0).all()) and bool((t.grad[~OFF] != 0.0).all())
