"""Group parallelism on torch.distributed (``blockdiag.distributed``): gloo on CPU, 2, 3 and 4 processes.

Each world size is one job: this file, run as a script in a subprocess (its own session, so a
timeout kills every process of it), forks ``world`` workers with
``torch.multiprocessing.start_processes``; each joins a gloo process group through a file
store, runs every check of its job and writes the measured errors to ``<tmp>/<job>-<rank>.json``.
The tests below assert on those numbers. One job per world size keeps the family to a few
process starts: the workers are forked from a launcher that has already imported torch and
blockdiag, so no worker pays the imports again.

The jobs, in order (the 2-rank job loads the 4-rank job's checkpoint):

* ``w4``: the forum's model needs divisibility here, so 50 heads on 4 ranks is the error path
  and ``heads=52`` the forum's shapes that divide; outputs, every gradient and 50 Adam steps
  against one process; float64; FSDP2 on a 2-D mesh ``("dp", "gp")``; a checkpoint saved.
* ``w2``: the forum's 50-head model itself (shared input and per-head input); a single
  ``GroupedLinear`` with a sharded input and a replicated output; float64; the checkpoint
  loaded on 2 ranks; ``to_heads`` refused and ``gather_model``.
* ``w3``: 6 heads on 3 ranks through several backends (8 heads refused); ``local_groups``'
  argument; layers whose weight a parametrization or a hook computes.
* ``raise``: a rank raises while the other waits in a collective: the job must fail fast.
* ``masked_meta``: a masked ``nn.Linear`` sharded on its own by FSDP2 from the meta device,
  then ``reset_parameters``.
* ``outside_mesh``: a model sharded over a mesh of one rank, called on a rank outside it.
* ``ddp``: ``GroupedLinear`` (several backends), ``GroupedMLP`` (each strategy) and a masked
  ``nn.Linear`` under ``DistributedDataParallel`` (buckets as gradients, static graph, unused
  parameters, ``no_sync``, ``ZeroRedundancyOptimizer``) against one process; a masked model
  trained with the PowerSGD hook, then loaded in place by ``torch.distributed.checkpoint``.

The checkpoint is then loaded once more in this process, with no process group, into a plain
``GroupedMLP`` (4 -> 2 -> 1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings

import pytest
import torch

# How long a whole job may take before it counts as hung (measured: well under a minute each
# on 2 busy cores); a hang fails the test instead of blocking CI.
JOB_TIMEOUT_S = 300
# A collective that waits longer than this raises in the worker (gloo's own timeout).
COLLECTIVE_TIMEOUT_S = 120

FORUM = {"in_features": 150, "hidden_features": [10, 10], "out_features": 1}
STEPS = 50
FLOAT32_BACKEND = "bmm"  # the backend of the 50-step float32 Adam comparisons (see _train_case)
F32_OUT, F32_GRAD, F32_TRAIN, F64 = 1e-5, 1e-5, 1e-4, 1e-12


def _available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available() and sys.platform.startswith("linux")


pytestmark = pytest.mark.skipif(not _available(), reason="needs torch.distributed with gloo on Linux")


# ----------------------------------------------------------------------------- launching


def _launch(job: str, world: int, tmp, timeout: float = JOB_TIMEOUT_S):
    """Run ``job`` on ``world`` processes; (exit code, output, seconds, per-rank results)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), job, str(world), str(tmp)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"job {job!r} on {world} processes hung for {timeout} s and was killed:\n{out[-6000:]}")
    seconds = time.monotonic() - t0
    results = []
    for rank in range(world):
        path = os.path.join(tmp, f"{job}-{rank}.json")
        results.append(_read_json(path) if os.path.exists(path) else None)
    return proc.returncode, out, seconds, results


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _run_ok(job: str, world: int, tmp):
    rc, out, seconds, results = _launch(job, world, tmp)
    assert rc == 0 and all(r is not None for r in results), f"job {job!r} failed (exit code {rc}):\n{out[-8000:]}"
    print(f"job {job} on {world} processes: {seconds:.1f} s")
    return results


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="module")
def w4(tmp):
    return _run_ok("w4", 4, tmp)


@pytest.fixture(scope="module")
def w2(tmp, w4):  # loads w4's checkpoint
    return _run_ok("w2", 2, tmp)


# ----------------------------------------------------------------------------- the tests


def test_import_blockdiag_does_not_load_dtensor(tmp, w4):
    # Measured in the launcher before it imports blockdiag.distributed.
    info = _read_json(os.path.join(tmp, "launcher-w4.json"))
    assert info["dtensor_after_import_blockdiag"] is False, info
    assert info["lazy_attribute"] == "blockdiag.distributed", info


@pytest.mark.parametrize("job", ["w2", "w4"])
@pytest.mark.parametrize("case", ["forum_shared", "forum_per_head"])
def test_outputs_gradients_and_adam_equal_one_process(request, job, case):
    results = request.getfixturevalue(job)
    for rank, r in enumerate(results):
        c = r[case]
        assert c["heads"] == (50 if job == "w2" else 52), c
        assert c["out"] < F32_OUT and c["grad"] < F32_GRAD, (rank, c)
        assert len(c["losses"]) == STEPS and c["loss"] < F32_TRAIN and c["params"] < F32_TRAIN, (rank, c)
        # Rank-local: the stack itself communicates nothing; a replicated output is one all-gather.
        assert c["comms"] == c["expected_comms"], (rank, c)
        # Each rank holds 1/world of every layer's weight.
        assert c["local_weight_numel"] * len(results) == c["weight_numel"], (rank, c)


@pytest.mark.parametrize("job", ["w2", "w4"])
def test_float64_exact(request, job):
    for rank, r in enumerate(request.getfixturevalue(job)):
        for name, err in r["float64"].items():
            assert err < F64, (rank, name, err)
        # Forward: the replicated output's all-gather; backward: the input gradient's
        # all-reduce (shared input) or all-gather (per-head input); nothing else.
        for name, (fwd, bwd) in r["float64_comms"].items():
            assert fwd == 1 and bwd == 1, (rank, name, fwd, bwd)


def test_backward_flags_key_the_sharding_cache(w2):
    for rank, r in enumerate(w2):
        assert r["backward_flags"] == [], (rank, r["backward_flags"])


def test_grouped_linear_sharded_input_replicated_output(w2):
    for rank, r in enumerate(w2):
        c = r["linear"]
        assert c["out"] < F64 and c["grad"] < F64 and c["placements"] == "(Shard(dim=0),)", (rank, c)


def test_uneven_groups_refused_naming_groups_and_world(w4):
    for rank, r in enumerate(w4):
        msgs = r["uneven"]
        assert "heads=50" in msgs["mlp"] and "4 ranks" in msgs["mlp"] and "52" in msgs["mlp"], msgs
        assert "groups=6" in msgs["linear"] and "4 ranks" in msgs["linear"], msgs
        assert "6 groups" in msgs["dtensor"] and "4 ranks" in msgs["dtensor"], msgs
        assert "2-D mesh" in msgs["mesh"] and "gp" in msgs["mesh"], msgs


def test_fsdp2_on_2d_mesh(w4):
    for rank, r in enumerate(w4):
        c = r["fsdp2"]
        assert c["out"] < F32_OUT and c["grad"] < F32_GRAD, (rank, c)
        assert c["loss"] < F32_TRAIN and c["params"] < F32_TRAIN and len(c["losses"]) == STEPS, (rank, c)
        assert c["gathered"] < F32_TRAIN and c["gathered_plain"], (rank, c)


def test_checkpoint_4_to_2_to_1(tmp, w4, w2):
    import torch.distributed.checkpoint as dcp

    import blockdiag

    for rank, r in enumerate(w2):
        assert r["checkpoint"]["state"] == 0.0 and r["checkpoint"]["out"] < F32_OUT, (rank, r["checkpoint"])
    ref = torch.load(os.path.join(tmp, "ckpt-ref.pt"))
    model = blockdiag.GroupedMLP(**FORUM, heads=52)
    state = model.state_dict()
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=os.path.join(tmp, "ckpt"), no_dist=True)
    model.load_state_dict(state)
    assert state.keys() == ref.keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_to_heads_refused_then_gathered(w2):
    for rank, r in enumerate(w2):
        c = r["to_heads"]
        assert "gather_model" in c["message"] and "DTensor" in c["message"], c
        assert "'heads.0.0.weight' is a DTensor" in c["from_heads_message"], c
        assert c["gathered"] < F32_OUT, c
        assert "'layers.0.weight' is already a DTensor" in c["twice"], c


def test_masked_linear_under_fsdp2_saves_and_loads(w2):
    for r in w2:
        c = r["masked_fsdp2"]
        assert c["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"], c
        assert c["off_block"] == 0.0 and c["round_trip"] == 0.0, c


def test_double_backward_through_a_group_parallel_layer(w2):
    for r in w2:
        c = r["double_backward"]
        assert c["input_grad"] <= F64 and c["weight_grad"] <= F64, c


def test_dtensor_inputs_in_any_layout(w2):
    # Rows sharded unevenly (2-D and 3-D), another batch dimension sharded, a partial sum.
    for r in w2:
        c = r["dtensor_inputs"]
        assert len(c) == 4 and all(e <= F64 for e in c.values()), c


def test_one_group_layer_dtensor_rows_sharded_unevenly_and_unshareable_sharded_input(w2):
    # The shared-input model's first layer (column parallel) reads the whole input: a 3-D
    # input whose rows the ranks do not divide is replicated first (it could not be flattened).
    for r in w2:
        c = dict(r["dtensor_inputs_one_group"])
        assert "in_features=5, which 2 ranks cannot share evenly" in c.pop("uneven_input"), r
        assert sorted(c) == ["linear", "mlp"] and all(isinstance(e, float) and e <= F64 for e in c.values()), c


def test_refusals_on_a_group_parallel_model_name_the_cause(w2):
    for r in w2:
        m = r["messages"]
        assert ("with input_layouts=Shard(-1) each rank passes its own groups' features, [..., 20 / 2 = 10]; "
                "this rank passed shape (3, 20) (the whole input?") in m["whole_input"], m
        assert "layers[0].weight is not a plain tensor parameter (a DTensor of group parallelism" in m["fm_chain"], m


def test_reset_parameters_of_a_distributed_layer_equals_a_plain_layers(w2):
    # On a CPU mesh DTensor draws each rank's shard from the rank's own generator: ranks seeded
    # alike would get copies of each other's groups. Drawn whole, the values are a plain layer's.
    for r in w2:
        assert r["reset_parameters"] == {"group_parallel": 0.0, "fsdp2": 0.0}, r["reset_parameters"]


def test_input_passed_as_keyword(w2):
    # model(x=batch) is prepared as model(batch) is (the layout hooks see keyword arguments).
    for r in w2:
        assert r["keyword_input"] == {"linear": 0.0, "mlp": 0.0, "mlp_sharded_input": 0.0}, r["keyword_input"]


def test_empty_batches_through_group_parallel_modules(w2):
    # DTensor's view rule fails on shapes with a zero ("integer modulo by zero"); plain modules
    # take empty batches, and so must group-parallel ones, output shard shapes and backward too.
    for r in w2:
        assert len(r["empty_inputs"]) == 9
        for key, got in r["empty_inputs"].items():
            assert isinstance(got, list), (key, got)
            shape, want, grads = got
            assert shape == want and grads == 0.0, (key, got)


def test_dtensor_input_on_another_mesh_refused_naming_both(w2):
    for r in w2:
        for key, m in r["input_on_another_mesh"].items():
            assert m.startswith("BlockDiagError: ") and "the input is a DTensor on DeviceMesh((dp=1, gp=2)" in m, (key, m)
            assert "parameters are sharded over DeviceMesh((gp=2)" in m, (key, m)


def test_gather_model_keeps_layer_backends_and_eval_mode(w2):
    for r in w2:
        assert r["gathered_mixed"] == {"backends": ["auto", "bmm"], "training": [False]}, r["gathered_mixed"]


def test_compiled_group_parallel_layer_over_a_warm_compile_cache(tmp, monkeypatch):
    # Twice over one inductor cache: the second launch's ranks are served the first's graphs.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    for launch in ("cold", "warm"):
        where = tmp / f"compiled-{launch}"  # each launch its own file store
        where.mkdir()
        for rank, r in enumerate(_run_ok("compiled", 2, where)):
            assert {"sharded-input-0", "sharded-input-1"} <= r.keys(), r.keys()
            for backend, c in r.items():
                assert isinstance(c["out"], float) and c["out"] <= F64 and c["grad"] <= F64, (launch, rank, backend, c)


@pytest.fixture(scope="module")
def ddp(tmp):
    return _run_ok("ddp", 2, tmp)


def test_ddp_trains_as_one_process_on_the_concatenated_batch(ddp):
    # Every configuration of DDP that keeps gradients exact: buckets as the gradients' storage,
    # a static graph, unused-parameter search, no_sync accumulation, ZeroRedundancyOptimizer.
    for rank, r in enumerate(ddp):
        assert len(r["ddp"]) >= len(DDP_CONFIGS) * 8, sorted(r["ddp"])
        for key, c in r["ddp"].items():
            assert c["diff"] <= DDP_TOL and c["original"] == 0.0 and c["weight"] == 0.0, (rank, key, c)


def test_masked_linear_trained_with_powersgd_loads_a_checkpoint_in_place(ddp):
    # PowerSGD's low-rank gradients put values into `original` off the blocks (never into
    # `weight`); the state dict's entry was then a masked copy, so dcp.load into
    # model.state_dict() loaded the biases and silently kept the trained weights.
    for rank, r in enumerate(ddp):
        c = r["powersgd"]
        assert c["trained"]["original"] > 0.0 and c["trained"]["weight"] == 0.0, (rank, c)
        assert c["loaded"] == 0.0 and c["after_load"] == {"original": 0.0, "weight": 0.0}, (rank, c)


def test_a_rank_that_raises_does_not_hang_the_others(tmp):
    rc, out, seconds, _ = _launch("raise", 2, tmp, timeout=120)
    assert rc != 0 and "rank 1 fails on purpose" in out, out[-4000:]
    assert seconds < 60, f"the job took {seconds:.0f} s to fail"


def test_masked_linear_sharded_on_its_own_by_fsdp2_resets_from_the_meta_device(tmp):
    # fully_shard(linear) derives a class from the masked one; its reset_parameters recursed,
    # and removing the mask through it failed half-way in torch's parametrize.
    for rank, r in enumerate(_run_ok("masked_meta", 2, tmp)):
        c = r["masked_meta"]
        assert c["error"] == "", (rank, c)
        assert c["off_block"] == 0.0 and 0.0 < c["block_max"] <= c["bound"] and c["out_shape"] == [3, 2], (rank, c)
        assert c["remove"].startswith("BlockDiagError: remove_block_diagonal_mask_: FSDPParametrizedLinear is a class "
                                      "derived from the masked ParametrizedLinear"), (rank, c)
        assert c["still_masked"] and c["runs_after"] == [3, 2], (rank, c)


def test_a_rank_outside_the_mesh_is_told_so(tmp):
    # DTensor computes nothing on a rank outside the mesh (empty outputs); the next layer
    # blamed input_layouts=Shard(-1), which nobody passed, and local_groups raised an IndexError.
    rank0, rank1 = _run_ok("outside_mesh", 2, tmp)
    assert rank0["outside_mesh"] == {"mlp": [3, 4], "local_groups": [0, 2]}, rank0
    for key in ("mlp", "local_groups"):
        m = rank1["outside_mesh"][key]
        assert m.startswith("BlockDiagError: ") and "(global rank 1) is not in DeviceMesh" in m, (key, m)
        assert "Shard(-1)" not in m, (key, m)


@pytest.fixture(scope="module")
def w3(tmp):
    return [r["w3"] for r in _run_ok("w3", 3, tmp)]


def test_three_ranks_train_as_one_process_with_each_backend(w3):
    for rank, r in enumerate(w3):
        assert r["local_groups"] == 2 * rank, (rank, r)
        cases = [k for k in r if k.endswith(("-shared", "-per_head"))]
        assert len(cases) >= 6, (rank, sorted(r))
        for k in cases:
            assert r[k]["out"] < F64 and r[k]["grad"] < F64 and r[k]["params"] < F64, (rank, k, r[k])
            assert isinstance(r[k]["gathered"], float) and r[k]["gathered"] < F64, (rank, k, r[k])
        assert "heads=8 cannot be split evenly over 3 ranks" in r["uneven"], (rank, r["uneven"])


def test_local_groups_refuses_a_count_that_is_not_a_positive_int(w3):
    # A zero or negative count gave every rank an empty or negative range, a float or a model
    # a bare TypeError from range().
    for rank, r in enumerate(w3):
        for bad, shown in (("zero", "got 0 (int)"), ("negative", "got -3 (int)"), ("float", "got 6.0 (float)"),
                           ("bool", "got True (bool)"), ("model", "a GroupedMLP module; pass its count (model.heads)")):
            m = r[f"count_{bad}"]
            assert isinstance(m, str) and m.startswith("BlockDiagError: local_groups: groups must be a positive int"), (
                rank, bad, m)
            assert shown in m, (rank, bad, m)


def test_a_computed_weight_is_replicated_trains_as_one_process_and_gathers(w3):
    # The guide: what a parametrization or hook computes from is not sharded by group (it may
    # mix groups, as spectral_norm does), DTensor replicates it, and the layer trains exactly.
    for rank, r in enumerate(w3):
        for name, original in (("parametrized", "layers.1.parametrizations.weight.original"),
                               ("pruned", "layers.1.weight_orig"),
                               ("spectral_norm", "layers.1.parametrizations.weight.original")):
            c = r[name]
            assert isinstance(c, dict), (rank, name, c)
            assert c["out"] < F64 and c["grad"] < F64 and c["params"] < F64, (rank, name, c)
            assert c["placements"][original] == "(Replicate(),)", (rank, name, c["placements"])
            assert c["placements"]["layers.1.bias"] == "(Shard(dim=0),)", (rank, name, c["placements"])
            # gather_model copies the weight it computes (load_state_dict failed on the keys
            # parametrizations.weight.original, weight_orig, ... that a plain model lacks).
            assert isinstance(c["gathered"], float) and c["gathered"] < F64, (rank, name, c)
            assert c["gathered_keys"] == ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"], (
                rank, name, c["gathered_keys"])
            assert c["gathered_eval"], (rank, name, c)
        # What the guide says of weight_norm under DTensor in this torch (no sharding rule for its
        # backward); a torch that gains one must train it exactly instead.
        c = r["weight_norm"]
        if isinstance(c, dict):
            assert c["out"] < F64 and c["grad"] < F64 and c["params"] < F64, (rank, c)
        else:
            assert c.startswith("NotImplementedError") and "_weight_norm_interface_backward" in c, (rank, c)


def test_arguments_refused_without_a_process_group():
    from torch.distributed.tensor import Replicate, Shard

    import blockdiag
    from blockdiag import distributed as bdd

    with pytest.raises(blockdiag.BlockDiagError, match=r"input_layouts must be Replicate\(\) or Shard\(-1\)"):
        bdd.GroupParallel(input_layouts=Shard(0))
    with pytest.raises(blockdiag.BlockDiagError, match="DeviceMesh"):
        bdd.parallelize_groups(blockdiag.GroupedLinear(4, 4, 2), "not a mesh")
    with pytest.raises(blockdiag.BlockDiagError, match="GroupedMLP or GroupedLinear"):
        bdd.parallelize_groups(torch.nn.Linear(4, 4), "not a mesh")
    assert repr(bdd.GroupParallel(output_layouts=Replicate())) == (
        f"GroupParallel(input_layouts={Replicate()}, output_layouts={Replicate()}, use_local_output=True)"
    )


# ----------------------------------------------------------------------------- the workers
#
# Everything below runs in the job's processes, not in pytest's.


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _err(a, b) -> float:
    return float((_full(a).detach().double() - _full(b).detach().double()).abs().max())


def _comm_mode():
    """Counts the collectives DTensor issues inside it (``get_total_counts()``)."""
    from torch.distributed.tensor.debug import CommDebugMode

    return CommDebugMode()


def _train_case(mesh, heads, shared, *, sharded_input=False, replicated_output=False, dtype=torch.float32, steps=STEPS):
    """One model, single process against group parallel: outputs, gradients, then Adam."""
    import copy

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    import blockdiag
    from blockdiag import distributed as bdd

    torch.manual_seed(0)
    # One named backend on both sides: with `auto`, a rank plans for its G/world groups and the
    # single process for G, so they may pick different kernels (e.g. simd against bmm), whose
    # float32 rounding differs and grows over 50 Adam steps past the tolerance. The float64
    # cases keep `auto` (see _float64_cases).
    ref = blockdiag.GroupedMLP(**FORUM, heads=heads, shared_input=shared, dtype=dtype, backend=FLOAT32_BACKEND)
    par = copy.deepcopy(ref)
    bdd.parallelize_groups(
        par, mesh,
        input_layouts=Shard(-1) if sharded_input else Replicate(),
        output_layouts=Replicate() if replicated_output else Shard(-1),
    )
    n = 64
    x = torch.randn(n, FORUM["in_features"] * (1 if shared else heads), dtype=dtype)
    target = torch.randn(n, heads, dtype=dtype)
    mine = bdd.local_groups(heads, mesh)
    cols = slice(mine.start, mine.stop)
    x_in = x[:, mine.start * FORUM["in_features"]:mine.stop * FORUM["in_features"]] if sharded_input else x
    scale = n * heads  # the loss: mean squared error over every head's output

    def par_loss():
        y = par(x_in)
        if replicated_output:
            return y, (y - target).pow(2).sum() / scale
        return y, (y - target[:, cols]).pow(2).sum() / scale  # this rank's heads' share

    def ref_loss():
        y = ref(x)
        return y, (y - target).pow(2).sum() / scale

    out = {"heads": heads}
    y_ref, l_ref = ref_loss()
    l_ref.backward()
    with _comm_mode() as mode:
        y, loss = par_loss()
        loss.backward()
    out["comms"] = mode.get_total_counts()
    out["expected_comms"] = 1 if replicated_output else 0
    out["out"] = _err(y, y_ref if replicated_output else y_ref[:, cols])
    out["grad"] = max(_err(p.grad, q.grad) for p, q in zip(par.parameters(), ref.parameters()))
    w = par.layers[-1].weight
    out["local_weight_numel"], out["weight_numel"] = w.to_local().numel(), w.numel()

    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_par = torch.optim.Adam(par.parameters(), lr=1e-2)
    losses, loss_err = [], 0.0
    for _ in range(steps):
        opt_ref.step(), opt_par.step()
        opt_ref.zero_grad(), opt_par.zero_grad()
        _, l_ref = ref_loss()
        _, l_par = par_loss()
        l_ref.backward(), l_par.backward()
        total = l_par.detach().clone()
        if not replicated_output:
            dist.all_reduce(total)  # the per-rank shares of the loss, for the record
        losses.append(total.item())
        loss_err = max(loss_err, abs(total.item() - l_ref.item()))
    out["losses"], out["loss"] = losses, loss_err
    out["params"] = max(_err(p, q) for p, q in zip(par.parameters(), ref.parameters()))
    return out, ref, par


def _float64_cases(mesh, world):
    """Outputs and gradients in float64, to 1e-12, for models where the flags matter too."""
    import copy

    from torch.distributed.tensor import Replicate

    import blockdiag
    from blockdiag import distributed as bdd

    errs, comms = {}, {}
    for shared in (True, False):
        # Equal layer shapes: the backward op of the first layer (input needs no gradient)
        # and of the others (it does) differ only in their flags, which must key the cache.
        for hidden in ([6, 6], []):
            torch.manual_seed(1)
            heads = 2 * world
            ref = blockdiag.GroupedMLP(6, hidden, 6, heads=heads, shared_input=shared, dtype=torch.float64)
            par = bdd.parallelize_groups(copy.deepcopy(ref), mesh, output_layouts=Replicate())
            # A 3-D input that needs its gradient too (an all-reduce or all-gather in backward).
            x = torch.randn(3, 5, 6 * (1 if shared else heads), dtype=torch.float64)
            xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
            key = f"{'shared' if shared else 'per_head'}-{len(hidden)}hidden"
            with _comm_mode() as fwd:
                y = par(xp)
            with _comm_mode() as bwd:
                (y * torch.arange(y.shape[-1], dtype=y.dtype)).sum().backward()
            yr = ref(xr)
            (yr * torch.arange(yr.shape[-1], dtype=yr.dtype)).sum().backward()
            # The output's all-gather; the input gradient's all-reduce (shared) or all-gather.
            comms[key] = [fwd.get_total_counts(), bwd.get_total_counts()]
            errs[key + "-out"] = _err(y, yr)
            errs[key + "-grad"] = max(_err(p.grad, q.grad) for p, q in zip(par.parameters(), ref.parameters()))
            errs[key + "-input_grad"] = _err(xp.grad, xr.grad)
            with torch.no_grad():  # auto's train flag false
                errs[key + "-no_grad"] = _err(par(x), ref(x))
    return errs, comms


def _uneven(mesh, mesh2, world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import blockdiag
    from blockdiag import distributed as bdd

    msgs = {}
    for key, fn in (
        ("mlp", lambda: bdd.parallelize_groups(blockdiag.GroupedMLP(**FORUM, heads=50), mesh)),
        ("linear", lambda: bdd.parallelize_groups(blockdiag.GroupedLinear(12, 6, 6), mesh)),
    ):
        try:
            fn()
            msgs[key] = "not refused"
        except blockdiag.BlockDiagError as e:
            msgs[key] = str(e)
    # A weight sharded by hand over ranks that do not divide its groups: the rule refuses it.
    layer = blockdiag.GroupedLinear(12, 6, 6)
    layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    layer.bias = torch.nn.Parameter(distribute_tensor(layer.bias.detach(), mesh, [Shard(0)]))
    try:
        layer(distribute_tensor(torch.randn(3, 12), mesh, [Replicate()]))
        msgs["dtensor"] = "not refused"
    except bdd.UnevenGroupsError as e:  # a BlockDiagError, not wrapped by DTensor's dispatcher
        msgs["dtensor"] = str(e)
    try:
        bdd.parallelize_groups(blockdiag.GroupedMLP(**FORUM, heads=52), mesh2)
        msgs["mesh"] = "not refused"
    except blockdiag.BlockDiagError as e:
        msgs["mesh"] = str(e)
    return msgs


def _fsdp2(mesh):
    """FSDP2 on "dp" and group parallelism on "gp" of a 2-D mesh, against one process."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import blockdiag
    from blockdiag import distributed as bdd

    dp = mesh["dp"].size()
    heads, n = 50, 64
    torch.manual_seed(0)
    ref = blockdiag.GroupedMLP(**FORUM, heads=heads, backend=FLOAT32_BACKEND)  # see _train_case
    par = copy.deepcopy(ref)
    bdd.parallelize_groups(par, mesh["gp"])
    fully_shard(par, mesh=mesh["dp"])
    x, target = torch.randn(n, FORUM["in_features"]), torch.randn(n, heads)
    d = mesh["dp"].get_local_rank()
    rows = slice(d * n // dp, (d + 1) * n // dp)
    mine = bdd.local_groups(heads, mesh["gp"])
    cols = slice(mine.start, mine.stop)

    def par_loss():
        y = par(x[rows])
        # FSDP2 averages the gradients over "dp": each dp rank's share, times dp.
        return y, (y - target[rows, cols]).pow(2).sum() * dp / (n * heads)

    def ref_loss():
        y = ref(x)
        return y, (y - target).pow(2).sum() / (n * heads)

    out = {}
    y, l_par = par_loss()
    y_ref, l_ref = ref_loss()
    l_par.backward(), l_ref.backward()
    out["out"] = _err(y, y_ref[rows, cols])
    out["grad"] = max(_err(p.grad, q.grad) for p, q in zip(par.parameters(), ref.parameters()))
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_par = torch.optim.Adam(par.parameters(), lr=1e-2)
    losses, loss_err = [], 0.0
    for _ in range(STEPS):
        opt_ref.step(), opt_par.step()
        opt_ref.zero_grad(), opt_par.zero_grad()
        _, l_ref = ref_loss()
        _, l_par = par_loss()
        l_ref.backward(), l_par.backward()
        total = l_par.detach().clone() / dp
        dist.all_reduce(total)
        losses.append(total.item())
        loss_err = max(loss_err, abs(total.item() - l_ref.item()))
    out["losses"], out["loss"] = losses, loss_err
    out["params"] = max(_err(p, q) for p, q in zip(par.parameters(), ref.parameters()))
    plain = bdd.gather_model(par)
    out["gathered"] = max(_err(p, q) for p, q in zip(plain.parameters(), ref.parameters()))
    out["gathered_plain"] = all(type(p) is torch.nn.Parameter for p in plain.parameters())
    return out


def _linear_case(mesh, world):
    """parallelize_module with GroupParallel on one GroupedLinear: sharded input, replicated output, no bias."""
    import copy

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    import blockdiag
    from blockdiag import distributed as bdd

    torch.manual_seed(2)
    g, i, o = 2 * world, 3, 4
    ref = blockdiag.GroupedLinear(g * i, g * o, g, bias=False, backend="bmm", dtype=torch.float64)
    par = parallelize_module(copy.deepcopy(ref), mesh, bdd.GroupParallel(input_layouts=Shard(-1), output_layouts=Replicate()))
    x = torch.randn(2, 5, g * i, dtype=torch.float64, requires_grad=True)
    mine = bdd.local_groups(g, mesh)
    x_local = x.detach()[..., mine.start * i:mine.stop * i].requires_grad_()
    y, yr = par(x_local), ref(x)
    y.pow(2).sum().backward(), yr.pow(2).sum().backward()
    return {
        "out": _err(y, yr),
        "grad": max(_err(par.weight.grad, ref.weight.grad), _err(x_local.grad, x.grad[..., mine.start * i:mine.stop * i])),
        "placements": str(par.weight.placements),
    }


def _backward_flags(mesh, world):
    """A backward op called with the same operands and other flags: the flags key DTensor's cache.

    (``register_sharding`` leaves bool arguments out of the key, so the second call would get the
    first call's output shapes.) Returns the calls whose global shapes are wrong.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g, i, o, n = 2 * world, 3, 3, 5
    w = distribute_tensor(torch.randn(g, o, i), mesh, [Shard(0)])
    x = distribute_tensor(torch.randn(n, g * i), mesh, [Replicate()])
    gy = distribute_tensor(torch.randn(n, g * o), mesh, [Replicate()])
    wrong = []
    for has_bias, need_x, need_w in ((True, False, True), (True, True, True), (False, True, False)):
        got = [tuple(t.shape) for t in torch.ops.blockdiag.bmm_backward.default(gy, x, w, has_bias, need_x, need_w)]
        want = [(n, g * i) if need_x else (0,), (g, o, i) if need_w else (0,), (g * o,) if has_bias else (0,)]
        if got != want:
            wrong.append([has_bias, need_x, need_w, got])
    return wrong


def _job_w4(rank, world, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag import distributed as bdd

    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "gp"))
    res = {"uneven": _uneven(mesh, mesh2, world)}
    res["forum_shared"], _, par = _train_case(mesh, 52, True)
    # The trained model's checkpoint, for the 2-rank job and for one process.
    dcp.save(par.state_dict(), checkpoint_id=os.path.join(tmp, "ckpt"))
    full = bdd.gather_model(par).state_dict()
    if rank == 0:
        torch.save(full, os.path.join(tmp, "ckpt-ref.pt"))
    res["forum_per_head"], _, _ = _train_case(mesh, 52, False, replicated_output=True)
    res["float64"], res["float64_comms"] = _float64_cases(mesh, world)
    res["fsdp2"] = _fsdp2(mesh2)
    return res


def _job_w2(rank, world, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import blockdiag
    from blockdiag import distributed as bdd

    mesh = init_device_mesh("cpu", (world,))
    res = {}
    res["forum_shared"], _, par = _train_case(mesh, 50, True)
    # to_heads / from_heads on a group-parallel model: refused, pointing at gather_model.
    c = {}
    try:
        par.to_heads()
        c["message"] = ""
    except blockdiag.BlockDiagError as e:
        c["message"] = str(e)
    try:  # heads whose Linear layers are DTensors (tensor parallel)
        head = torch.nn.Sequential(parallelize_module(torch.nn.Linear(4, 2), mesh, ColwiseParallel()))
        blockdiag.GroupedMLP.from_heads([head, head])
        c["from_heads_message"] = ""
    except blockdiag.BlockDiagError as e:
        c["from_heads_message"] = str(e)
    try:
        bdd.parallelize_groups(par, mesh)
        c["twice"] = ""
    except blockdiag.BlockDiagError as e:
        c["twice"] = str(e)
    heads = bdd.gather_model(par).to_heads()
    x = torch.randn(4, FORUM["in_features"])
    mine = bdd.local_groups(50, mesh)
    c["gathered"] = _err(torch.cat([h(x) for h in heads[mine.start:mine.stop]], -1), par(x))
    res["to_heads"] = c
    res["forum_per_head"], _, _ = _train_case(mesh, 50, False, sharded_input=True, replicated_output=True)
    res["float64"], res["float64_comms"] = _float64_cases(mesh, world)
    res["linear"] = _linear_case(mesh, world)
    res["masked_fsdp2"] = _masked_fsdp2(mesh)
    res["double_backward"] = _double_backward(mesh, world)
    res["dtensor_inputs"] = _dtensor_inputs(mesh, world)
    res["dtensor_inputs_one_group"] = _dtensor_inputs_one_group(mesh, world)
    res["input_on_another_mesh"] = _input_on_another_mesh(world)
    res["keyword_input"] = _keyword_input(mesh, world)
    res["empty_inputs"] = _empty_inputs(mesh, world)
    res["messages"] = _messages(mesh, world)
    res["reset_parameters"] = _reset_parameters(mesh, world)
    # gather_model keeps each layer's backend ("mixed" is no backend name) and eval mode.
    mixed = blockdiag.GroupedMLP(4, [6], 2, heads=2 * world).eval()
    mixed.layers[1].backend = "bmm"
    bdd.parallelize_groups(mixed, mesh)
    plain = bdd.gather_model(mixed)
    res["gathered_mixed"] = {"backends": [layer.backend for layer in plain.layers],
                             "training": sorted({m.training for m in plain.modules()})}
    res["backward_flags"] = _backward_flags(mesh, world)
    # The 4-rank checkpoint, resharded onto 2 ranks.
    model = blockdiag.GroupedMLP(**FORUM, heads=52)
    bdd.parallelize_groups(model, mesh, output_layouts=Replicate())
    state = model.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(tmp, "ckpt"))
    model.load_state_dict(state)
    saved = torch.load(os.path.join(tmp, "ckpt-ref.pt"))
    gathered = bdd.gather_model(model).state_dict()
    plain = blockdiag.GroupedMLP(**FORUM, heads=52)
    plain.load_state_dict(saved)
    x = torch.randn(8, FORUM["in_features"])
    res["checkpoint"] = {
        "state": max(_err(gathered[k], v) for k, v in saved.items()),
        "out": _err(model(x), plain(x)),
    }
    return res


def _job_compiled(rank, world, tmp):
    """torch.compile (inductor) of a group-parallel GroupedLinear, training step, float64.

    Launched twice over one inductor cache: the second launch is served the graphs the first
    compiled, which must not carry rank 0's slice of the replicated input to rank 1.
    """
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import blockdiag
    from blockdiag import distributed as bdd

    mesh = init_device_mesh("cpu", (world,))
    g, i, o = 3 * world, 3, 2
    mine = bdd.local_groups(g, mesh)
    res = {}
    # First (before any other compile of the layer): layers of two widths with an input sharded
    # by group, compiled one after the other; the second compile traces the local width as a
    # symbol (automatic dynamic shapes).
    for k, i_k in enumerate((3, 5)):
        torch.manual_seed(2)
        layer = blockdiag.GroupedLinear(g * i_k, g * o, g, dtype=torch.float64)
        ref = copy.deepcopy(layer)
        bdd.parallelize_groups(layer, mesh, input_layouts=Shard(-1))
        x = torch.randn(5, g * i_k, dtype=torch.float64)
        gy = torch.randn(5, g * o, dtype=torch.float64)
        try:
            y = torch.compile(layer)(x[:, mine.start * i_k:mine.stop * i_k])
            y.backward(gy[:, mine.start * o:mine.stop * o])
            ref(x).backward(gy)
            res[f"sharded-input-{k}"] = {"out": _err(y, ref(x)[:, mine.start * o:mine.stop * o]),
                                         "grad": max(_err(p.grad, q.grad) for p, q in zip(layer.parameters(), ref.parameters()))}
        except Exception as e:  # recorded, so that the job's other results still come back
            res[f"sharded-input-{k}"] = {"out": f"{type(e).__name__}: {e}"[:500], "grad": None}
    for backend in ("bmm", "auto"):
        torch.manual_seed(0)
        layer = blockdiag.GroupedLinear(g * i, g * o, g, backend=backend, dtype=torch.float64)
        ref = copy.deepcopy(layer)
        bdd.parallelize_groups(layer, mesh)
        x = torch.randn(7, g * i, dtype=torch.float64, requires_grad=True)
        gy = torch.randn(7, g * o, dtype=torch.float64)
        y = torch.compile(layer)(x)
        y.backward(gy[:, mine.start * o:mine.stop * o])
        yr = ref(x.detach())
        yr.backward(gy)
        res[backend] = {
            "out": _err(y, yr[:, mine.start * o:mine.stop * o]),
            "grad": max(_err(layer.weight.grad, ref.weight.grad), _err(layer.bias.grad, ref.bias.grad)),
        }
    # dynamic=True over three batch sizes: the layout hooks compare placements whose Shard.dim
    # dynamo traces as a symbolic int (building a Shard from it failed to trace), and the
    # model's replicated input reaches its first layer plain (see _parallelize_mlp).
    torch.manual_seed(1)
    models = {
        "dynamic-layer": blockdiag.GroupedLinear(g * i, g * o, g, backend="bmm", dtype=torch.float64),
        "dynamic-mlp": blockdiag.GroupedMLP(i, [4], o, heads=g, shared_input=False, dtype=torch.float64),
    }
    for name, model in models.items():
        ref = copy.deepcopy(model)
        bdd.parallelize_groups(model, mesh)
        compiled = torch.compile(model, dynamic=True)
        out = grad = 0.0
        for batch in (3, 7, 11):
            x = torch.randn(batch, g * i, dtype=torch.float64)
            gy = torch.randn(batch, g * o, dtype=torch.float64)
            model.zero_grad()
            ref.zero_grad()
            y = compiled(x)
            y.backward(gy[:, mine.start * o:mine.stop * o])
            yr = ref(x)
            yr.backward(gy)
            out = max(out, _err(y, yr[:, mine.start * o:mine.stop * o]))
            grad = max(grad, *(_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())))
        res[name] = {"out": out, "grad": grad}
    return res


def _double_backward(mesh, world):
    """create_graph=True through a group-parallel GroupedLinear (a gradient penalty), float64."""
    import copy

    import blockdiag
    from blockdiag import distributed as bdd

    g, i, o = 3 * world, 3, 2
    mine = bdd.local_groups(g, mesh)
    torch.manual_seed(4)
    layer = blockdiag.GroupedLinear(g * i, g * o, g, dtype=torch.float64)
    ref = copy.deepcopy(layer)
    bdd.parallelize_groups(layer, mesh)
    x = torch.randn(5, g * i, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    gx.pow(2).sum().backward()
    # The replicated input's gradient gathers every rank's: the whole layer's.
    (gr,) = torch.autograd.grad(ref(x).pow(2).sum(), x, create_graph=True)
    gr.pow(2).sum().backward()
    return {"input_grad": _err(gx, gr),
            "weight_grad": _err(layer.weight.grad.to_local(), ref.weight.grad[mine.start:mine.stop])}


def _dtensor_inputs(mesh, world):
    """DTensor inputs in other layouts (rows sharded unevenly, 3-D, partial), float64: errors."""
    import copy

    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import blockdiag
    from blockdiag import distributed as bdd

    g, i, o = 2 * world, 3, 2
    out = {}
    for shape, placement in [((5, g * i), Shard(0)), ((5, 3, g * i), Shard(0)), ((4, 5, g * i), Shard(1)),
                             ((4, 3, g * i), Partial())]:
        torch.manual_seed(5)
        layer = blockdiag.GroupedLinear(g * i, g * o, g, dtype=torch.float64)
        ref = copy.deepcopy(layer)
        bdd.parallelize_groups(layer, mesh, output_layouts=Replicate(), use_local_output=False)
        whole = torch.randn(shape, dtype=torch.float64)
        if isinstance(placement, Partial):  # each rank holds a share of the sum
            x = DTensor.from_local(whole / world, mesh, [placement]).requires_grad_()
        else:
            x = distribute_tensor(whole, mesh, [placement]).requires_grad_()
        y = layer(x)
        gy = torch.randn(shape[:-1] + (g * o,), dtype=torch.float64)
        y.backward(distribute_tensor(gy, mesh, [Replicate()]))
        xr = whole.clone().requires_grad_()
        ref(xr).backward(gy)
        out[f"{shape} {placement}"] = max(_err(y, ref(whole)), _err(x.grad, xr.grad),
                                          _err(layer.weight.grad, ref.weight.grad), _err(layer.bias.grad, ref.bias.grad))
    return out


def _dtensor_inputs_one_group(mesh, world):
    """A DTensor input, rows sharded unevenly (3-D), into the one-group (column-parallel) first
    layer of a shared-input GroupedMLP and into a one-group GroupedLinear: errors, or the failure."""
    import copy

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import blockdiag
    from blockdiag import distributed as bdd

    out = {}
    for name, make in (("mlp", lambda: blockdiag.GroupedMLP(5, [4], 2, heads=2 * world, dtype=torch.float64)),
                       ("linear", lambda: blockdiag.GroupedLinear(5, 4 * world, 1, dtype=torch.float64))):
        torch.manual_seed(6)
        model = make()
        ref = copy.deepcopy(model)
        bdd.parallelize_groups(model, mesh, output_layouts=Replicate())
        whole = torch.randn(world + 1, 3, 5, dtype=torch.float64)  # rows the ranks do not divide
        x = distribute_tensor(whole, mesh, [Shard(0)]).requires_grad_()
        xr = whole.clone().requires_grad_()
        try:
            y = model(x)
            y.pow(2).sum().backward()
            ref(xr).pow(2).sum().backward()
            out[name] = max(_err(y, ref(whole)), _err(x.grad, xr.grad),
                            *(_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())))
        except Exception as e:  # recorded, so that the rest of the job still runs
            out[name] = f"{type(e).__name__}: {e}"
    # A sharded input of a width the ranks cannot share: refused when parallelized, on every
    # rank (not on the ranks whose torch.chunk piece is wider, with the others in a collective).
    try:
        bdd.parallelize_groups(blockdiag.GroupedLinear(2 * world + 1, 2 * world, 1), mesh, input_layouts=Shard(-1))
        out["uneven_input"] = "not refused"
    except blockdiag.BlockDiagError as e:
        out["uneven_input"] = str(e)
    return out


def _reset_parameters(mesh, world):
    """Deferred init (meta device, distribute, to_empty, reset_parameters) against a plain model's
    reset_parameters under the same seed: the largest difference, group parallel and FSDP2."""
    from torch.distributed.fsdp import fully_shard

    import blockdiag
    from blockdiag import distributed as bdd

    heads = 2 * world
    ref = blockdiag.GroupedMLP(3, [4], 2, heads=heads)
    torch.manual_seed(7)
    for layer in ref.layers:
        layer.reset_parameters()
    out = {}
    for name, distribute in (("group_parallel", lambda m: bdd.parallelize_groups(m, mesh)),
                             ("fsdp2", lambda m: fully_shard(m, mesh=mesh))):
        with torch.device("meta"):
            model = blockdiag.GroupedMLP(3, [4], 2, heads=heads)
        distribute(model)
        model.to_empty(device="cpu")
        torch.manual_seed(7)
        with warnings.catch_warnings():  # DTensor's "random operators ... on cpu device mesh"
            warnings.simplefilter("ignore", UserWarning)
            for layer in model.layers:
                layer.reset_parameters()
        out[name] = max(_err(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    return out


def _keyword_input(mesh, world):
    """A group-parallel layer and model called as ``module(x=...)``: the difference from a
    positional call, or the failure."""
    from torch.distributed.tensor import Shard

    import blockdiag
    from blockdiag import distributed as bdd

    g = 2 * world
    out = {}
    for name, module, width, layouts in (
        ("linear", blockdiag.GroupedLinear(3 * g, 2 * g, g, dtype=torch.float64), 3 * g, {}),
        ("mlp", blockdiag.GroupedMLP(3, [4], 2, heads=g, dtype=torch.float64), 3, {}),
        ("mlp_sharded_input", blockdiag.GroupedMLP(3, [4], 2, heads=g, shared_input=False, dtype=torch.float64),
         3 * g // world, {"input_layouts": Shard(-1)}),
    ):
        bdd.parallelize_groups(module, mesh, **layouts)
        x = torch.randn(5, width, dtype=torch.float64)
        try:
            out[name] = _err(module(x=x), module(x))
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _empty_inputs(mesh, world):
    """Empty batches (``[2, 0, W]``, ``[0, 3, W]``, ``[0, W]``) through group-parallel modules:
    ``[output shape, plain module's output shape, sum of |gradients|]``, or the failure."""
    from torch.distributed.tensor import Replicate

    import blockdiag
    from blockdiag import distributed as bdd

    g = 2 * world
    out = {}
    for name, make, layouts in (
        ("linear", lambda: blockdiag.GroupedLinear(3 * g, 2 * g, g), {}),
        ("linear_replicated", lambda: blockdiag.GroupedLinear(3 * g, 2 * g, g), {"output_layouts": Replicate()}),
        ("mlp", lambda: blockdiag.GroupedMLP(3 * g, [4], 2, heads=g), {}),
    ):
        torch.manual_seed(0)
        plain = make()
        module = bdd.parallelize_groups(make(), mesh, **layouts)
        for lead in ((2, 0), (0, 3), (0,)):
            x = torch.randn(*lead, 3 * g)
            key = f"{name}{list(lead)}"
            try:
                y = module(x)
                y.sum().backward()
                grads = sum(float(_full(p.grad).abs().sum()) for p in module.parameters() if p.grad is not None)
                want = list(plain(x).shape)
                if "replicated" not in name:
                    want[-1] //= world
                out[key] = [list(y.shape), want, grads]
            except Exception as e:
                out[key] = f"{type(e).__name__}: {e}"
    return out


def _input_on_another_mesh(world):
    """A DTensor input on the 2-D mesh whose "gp" dimension the model is sharded over: the refusal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import blockdiag
    from blockdiag import distributed as bdd

    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "gp"))
    out = {}
    for shared in (True, False):
        model = blockdiag.GroupedMLP(3, [4], 2, heads=2 * world, shared_input=shared)
        bdd.parallelize_groups(model, mesh2["gp"])
        x = distribute_tensor(torch.randn(4, 3 if shared else 6 * world), mesh2, [Shard(0), Replicate()])
        try:
            model(x)
            out["shared" if shared else "per_head"] = "not refused"
        except Exception as e:
            out["shared" if shared else "per_head"] = f"{type(e).__name__}: {e}"
    return out


def _messages(mesh, world):
    """The refusals a group-parallel model gives: what each names."""
    from torch.distributed.tensor import Shard

    import blockdiag
    from blockdiag import distributed as bdd

    out = {}
    model = blockdiag.GroupedMLP(5, [4], 2, heads=2 * world, shared_input=False)
    bdd.parallelize_groups(model, mesh, input_layouts=Shard(-1))
    try:
        model(torch.randn(3, 5 * 2 * world))  # the whole input, not this rank's share
    except blockdiag.BlockDiagError as e:
        out["whole_input"] = str(e)
    chain = blockdiag.GroupedMLP(5, [4], 2, heads=2 * world)
    bdd.parallelize_groups(chain, mesh)
    chain.strategy = "fm_chain"
    try:
        chain(torch.randn(3, 5))
    except blockdiag.BlockDiagError as e:
        out["fm_chain"] = str(e)
    return out


def _masked_fsdp2(mesh):
    """mask_block_diagonal_ on an nn.Linear under FSDP2: its sharded state dict saves and loads."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import blockdiag

    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    blockdiag.mask_block_diagonal_(net[0], 3)
    fully_shard(net, mesh=mesh)
    net(torch.randn(4, 6)).sum().backward()
    sd = get_model_state_dict(net)
    full = {k: _full(v) for k, v in net.state_dict().items()}
    set_model_state_dict(net, sd)
    off = ~blockdiag.block_diag_mask(3, (4, 2))
    return {"keys": sorted(sd), "off_block": float(full["0.weight"][off].abs().max()),
            "round_trip": max(_err(_full(v), full[k]) for k, v in net.state_dict().items())}


# DDP (data parallelism of the whole model): each configuration below, over 2 ranks of DDP_ROWS rows
# each, against one process trained on the concatenated batch. SGD with momentum: a step is
# proportional to the gradient, so a gradient of the wrong scale would show (Adam's would not).
DDP_CONFIGS = ("plain", "gradient_as_bucket_view", "static_graph", "find_unused_parameters", "no_sync", "zero")
DDP_STEPS, DDP_ROWS, DDP_TOL = 3, 6, 1e-5


def _ddp_models():
    import blockdiag

    def masked():
        net = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        blockdiag.mask_block_diagonal_(net[0], 4)
        blockdiag.mask_block_diagonal_(net[2], 4)
        return net

    models = {f"linear-{b}": (lambda b=b: blockdiag.GroupedLinear(12, 8, groups=4, backend=b), 12)
              for b in ("auto", "simd", "bmm", "csr")}
    for strategy in ("auto", "fm_chain", "heads", "layers"):
        models[f"mlp-{strategy}"] = (lambda s=strategy: blockdiag.GroupedMLP(3, [4, 3], 2, heads=4, strategy=s), 3)
    models["masked"] = (masked, 12)
    return {k: v for k, v in models.items() if k != "linear-simd" or _simd_available()}


def _simd_available():
    import blockdiag

    return next(b.available for b in blockdiag.list_backends() if b.name == "simd")


def _off_blocks(net):
    """The largest magnitude outside the blocks, of ``original`` and of ``weight``, over masked layers."""
    worst = {"original": 0.0, "weight": 0.0}
    for m in net.modules():
        if hasattr(m, "parametrizations"):
            off = ~m.parametrizations.weight[0].mask
            for key, w in (("original", m.parametrizations.weight.original), ("weight", m.weight)):
                worst[key] = max(worst[key], float(w.detach()[off].abs().max()))
    return worst


def _ddp_train(rank, world, make, width, config):
    """(the largest parameter difference from one process, the model) after DDP_STEPS steps."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ref = make()
    net = copy.deepcopy(ref)
    kw = {config: True} if config in ("gradient_as_bucket_view", "static_graph", "find_unused_parameters") else {}
    ddp = DDP(net, **kw)
    opt_kw = {"lr": 0.5, "momentum": 0.9}
    if config == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, **opt_kw)
    else:
        opt = torch.optim.SGD(ddp.parameters(), **opt_kw)
    ref_opt = torch.optim.SGD(ref.parameters(), **opt_kw)
    gen = torch.Generator().manual_seed(1)
    mine = slice(rank * DDP_ROWS, (rank + 1) * DDP_ROWS)
    for _ in range(DDP_STEPS):
        xs = [torch.randn(world * DDP_ROWS, width, generator=gen) for _ in range(2 if config == "no_sync" else 1)]
        if config == "no_sync":  # two micro-batches, the first accumulated locally
            with ddp.no_sync():
                ddp(xs[0][mine]).square().mean().backward()
        ddp(xs[-1][mine]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sum(ref(x).square().mean() for x in xs).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = max(_err(a.detach(), b.detach()) for a, b in zip(net.parameters(), ref.parameters()))
    return diff, net


def _job_ddp(rank, world, tmp):
    """GroupedLinear, GroupedMLP and a masked nn.Linear under DDP, against one process; a masked
    model trained with PowerSGD (gradients non-zero off the blocks) checkpointed in place."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {"ddp": {}}
    for name, (make, width) in _ddp_models().items():
        for config in DDP_CONFIGS:
            diff, net = _ddp_train(rank, world, make, width, config)
            out["ddp"][f"{config}/{name}"] = {"diff": diff, **_off_blocks(net)}

    # PowerSGD replaces each gradient by a low-rank approximation of the whole [G*out, G*in]
    # matrix, which is not zero off the blocks: `original` takes values there, `weight` not.
    make, width = _ddp_models()["masked"]
    torch.manual_seed(0)
    net = make()
    ckpt = os.path.join(tmp, f"ddp-ckpt-{rank}")
    dcp.save(net.state_dict(), checkpoint_id=ckpt, no_dist=True)  # each rank its own copy
    ddp = DDP(net)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    torch.manual_seed(2)
    for _ in range(4):
        ddp(torch.randn(DDP_ROWS, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    trained = _off_blocks(net)
    sd = net.state_dict()
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)  # in place, as the checkpoint guide does
    torch.manual_seed(0)
    fresh = make()
    loaded = max(_err(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values()))
    out["powersgd"] = {"trained": trained, "after_load": _off_blocks(net), "loaded": loaded}
    dist.barrier()
    return out


def _job_masked_meta(rank, world, tmp):
    """FSDP2's deferred init of a masked nn.Linear sharded on its own (per layer, then the root),
    from the meta device: reset_parameters initialises ``original`` within the blocks."""
    import math

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import blockdiag

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        net = torch.nn.Sequential(blockdiag.mask_block_diagonal_(torch.nn.Linear(8, 6), 2), torch.nn.ReLU(),
                                  torch.nn.Linear(6, 2))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    net.to_empty(device="cpu")
    out = {"error": ""}
    try:
        with warnings.catch_warnings():  # DTensor's "random operators ... on cpu device mesh"
            warnings.simplefilter("ignore", UserWarning)
            for m in net.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
    except RecursionError as e:
        out["error"] = f"RecursionError: {e}"
        return {"masked_meta": out}
    w = _full(net[0].parametrizations.weight.original).detach()
    off = ~blockdiag.block_diag_mask(2, (3, 4))
    out["off_block"] = float(w[off].abs().max())
    out["block_max"] = float(w[~off].abs().max())
    out["bound"] = 1 / math.sqrt(8)  # nn.Linear's kaiming_uniform_(a=sqrt(5)) bound, 1/sqrt(fan_in)
    out["out_shape"] = list(net(torch.randn(3, 8)).shape)
    try:  # the mask cannot come off through fully_shard's derived class: named, nothing changed
        blockdiag.remove_block_diagonal_mask_(net[0])
        out["remove"] = "removed"
    except Exception as e:  # noqa: BLE001 - the type is the finding
        out["remove"] = f"{type(e).__name__}: {e}"
    out["still_masked"] = hasattr(net[0], "_blockdiag_hooks") and hasattr(type(net[0]), "weight")
    out["runs_after"] = list(net(torch.randn(3, 8)).shape)
    return {"masked_meta": out}


class _Twice(torch.nn.Module):
    """A parametrization of one's own: the weight it computes is twice its original."""

    def forward(self, w):
        return 2 * w


def _three_ranks_case(mesh, make, x, heads, steps=3):
    """One model against its group-parallel copy (built alike, same seed): outputs, gradients, Adam."""
    from blockdiag import distributed as bdd

    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    par = bdd.parallelize_groups(make(), mesh)
    mine = bdd.local_groups(heads, mesh)
    target = torch.randn(x.shape[0], 2 * heads, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    cols = slice(2 * mine.start, 2 * mine.stop)
    out = {"out": 0.0, "grad": 0.0}
    opt_ref, opt_par = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(par.parameters(), lr=1e-2)
    for _ in range(steps):
        y_ref, y = ref(x), par(x)
        out["out"] = max(out["out"], _err(y, y_ref[:, cols]))
        (y_ref - target).pow(2).sum().backward()
        (y - target[:, cols]).pow(2).sum().backward()
        out["grad"] = max(out["grad"], max(_err(p.grad, q.grad) for p, q in zip(par.parameters(), ref.parameters())))
        opt_ref.step(), opt_par.step()
        opt_ref.zero_grad(), opt_par.zero_grad()
    out["params"] = max(_err(p, q) for p, q in zip(par.parameters(), ref.parameters()))
    out["placements"] = {n: str(tuple(p.placements)) for n, p in par.named_parameters()}
    ref.eval(), par.eval()  # spectral_norm steps its power iteration in training only
    try:
        plain = bdd.gather_model(par)
        out["gathered"] = _err(plain(x), ref(x))
        out["gathered_keys"] = sorted(plain.state_dict())
        out["gathered_eval"] = not any(m.training for m in plain.modules())
    except Exception as e:  # noqa: BLE001 - the type is the finding
        out["gathered"] = f"{type(e).__name__}: {e}"
    return out


def _job_w3(rank, world, tmp):
    """Three ranks: heads the world divides (each backend), counts it does not, local_groups'
    argument, and layers whose weight a parametrization or a hook computes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.utils import parametrize, prune

    import blockdiag
    from blockdiag import distributed as bdd

    mesh = init_device_mesh("cpu", (world,))
    heads = 2 * world
    out = {"local_groups": bdd.local_groups(heads, mesh).start}
    for bad in ("zero", "negative", "float", "bool", "model"):
        value = {"zero": 0, "negative": -world, "float": float(heads), "bool": True,
                 "model": blockdiag.GroupedMLP(3, [4], 2, heads=heads)}[bad]
        try:
            got = bdd.local_groups(value, mesh)
            out[f"count_{bad}"] = [got.start, got.stop]
        except Exception as e:  # noqa: BLE001 - the type is the finding
            out[f"count_{bad}"] = f"{type(e).__name__}: {e}"
    try:
        bdd.parallelize_groups(blockdiag.GroupedMLP(3, [4], 2, heads=heads + 2), mesh)
        out["uneven"] = "sharded"
    except blockdiag.BlockDiagError as e:
        out["uneven"] = str(e)
    x = torch.randn(5, 3 * heads, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for backend in ("auto", "simd", "bmm_fm", "csr"):
        if backend == "simd" and not _simd_available():
            continue
        for shared in (True, False):
            out[f"{backend}-{'shared' if shared else 'per_head'}"] = _three_ranks_case(
                mesh, lambda s=shared, b=backend: blockdiag.GroupedMLP(3, [4], 2, heads=heads, shared_input=s, backend=b,
                                                                       dtype=torch.float64),
                x[:, :3] if shared else x, heads)

    def computed(how):
        def make():
            model = blockdiag.GroupedMLP(3, [4], 2, heads=heads, shared_input=False, dtype=torch.float64)
            for layer in model.layers:
                how(layer)
            return model
        return make

    for name, how in (("parametrized", lambda l: parametrize.register_parametrization(l, "weight", _Twice())),
                      ("pruned", lambda l: prune.random_unstructured(l, "weight", amount=0.3)),
                      ("spectral_norm", lambda l: torch.nn.utils.parametrizations.spectral_norm(l, "weight")),
                      ("weight_norm", lambda l: torch.nn.utils.parametrizations.weight_norm(l, "weight"))):
        try:
            out[name] = _three_ranks_case(mesh, computed(how), x, heads)
        except Exception as e:  # noqa: BLE001 - the type is the finding
            out[name] = f"{type(e).__name__}: {e}"
    return {"w3": out}


def _job_outside_mesh(rank, world, tmp):
    """A model sharded over a mesh of rank 0 alone, called on every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    import blockdiag
    from blockdiag import distributed as bdd

    mesh = DeviceMesh("cpu", [0])
    torch.manual_seed(0)
    model = bdd.parallelize_groups(blockdiag.GroupedMLP(5, [4], 2, heads=2, shared_input=False), mesh)
    out = {}
    for key, fn in (("mlp", lambda: list(model(torch.randn(3, 10)).shape)),
                    ("local_groups", lambda: [bdd.local_groups(2, mesh).start, bdd.local_groups(2, mesh).stop])):
        try:
            out[key] = fn()
        except (blockdiag.BlockDiagError, IndexError) as e:  # IndexError: torch's, before the check
            out[key] = f"{type(e).__name__}: {e}"
    return {"outside_mesh": out}


def _job_raise(rank, world, tmp):
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # never completes: rank 1 is gone
    return {}


JOBS = {"w4": _job_w4, "w3": _job_w3, "w2": _job_w2, "raise": _job_raise, "compiled": _job_compiled, "masked_meta": _job_masked_meta,
        "outside_mesh": _job_outside_mesh, "ddp": _job_ddp}


def _worker(rank, job, world, tmp):
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"file://{os.path.join(tmp, job + '-store')}",
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        res = JOBS[job](rank, world, tmp)
        dist.barrier()
    except BaseException:
        # Every failing rank's own traceback (the launcher reports only the first to exit,
        # which may be a rank whose peer vanished).
        sys.stderr.write(f"rank {rank} of job {job} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        raise
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"{job}-{rank}.json"), "w") as f:
        json.dump(res, f)


def _main(job: str, world: int, tmp: str) -> None:
    import torch.multiprocessing as mp

    if job != "raise":
        import blockdiag

        info = {"dtensor_after_import_blockdiag": "torch.distributed.tensor" in sys.modules}
        info["lazy_attribute"] = blockdiag.distributed.__name__
        # Everything the workers use, imported once here: they are forked from this process.
        import torch.distributed.checkpoint
        import torch.distributed.fsdp
        import torch.distributed.tensor.debug  # noqa: F401

        with open(os.path.join(tmp, f"launcher-{job}.json"), "w") as f:
            json.dump(info, f)
    mp.start_processes(_worker, args=(job, world, tmp), nprocs=world, start_method="fork")


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
