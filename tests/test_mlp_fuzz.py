"""``GroupedMLP`` against the loop of its heads, on seeded random cases (``tests/_mlp_fuzz.py``).

Each case draws the model (heads, shared input, sizes, 1-4 layers, per-layer bias,
activations in place or not, output activation, dtype, every strategy, backends), the grad
mode (training, frozen layers, no_grad, inference_mode, torch.func's jvp and vmap), the
input's layout and the calls made on one model (changing strategy, backend, train/eval in
between), and compares outputs and every gradient with ``to_heads()`` run as
``torch.cat([head(x_h) for head in heads], -1)`` in float64. A longer run is the same
generator over more seeds: ``for s in range(N): run(draw(random.Random(s)))``.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.func import vmap

import blockdiag

from _mlp_fuzz import draw, run

SEEDS = range(40)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:Sparse BSR tensor support is in beta")
@pytest.mark.parametrize("seed", SEEDS)
def test_grouped_mlp_matches_the_loop_of_its_heads(seed):
    case = draw(random.Random(seed))
    status, problem = run(case)
    assert problem is None, f"{case}: {problem}"
    assert status == "ok" or status.startswith("refused: "), status


def test_the_seeded_cases_run_more_than_they_refuse():
    # A generator whose every case were refused would check nothing.
    statuses = [run(draw(random.Random(s)))[0] for s in range(8)]
    assert sum(s == "ok" for s in statuses) >= 6, statuses


@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_an_in_place_activation_under_vmap_with_autograd_recording(strategy):
    # nn.ReLU(inplace=True) between the layers, vmapped while the parameters require grad
    # (the loop of nn.Linear heads runs it): the layers' Function under vmap returned its
    # batching rule's reshape, a view, and autograd refused the in-place ReLU.
    torch.manual_seed(0)
    m = blockdiag.GroupedMLP(4, [3], 3, heads=2, shared_input=False, strategy=strategy,
                             activation=lambda: nn.ReLU(inplace=True), dtype=torch.float64)
    heads = m.to_heads()
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    y = vmap(m)(x)
    want = torch.cat([h(p) for h, p in zip(heads, x.split(4, -1))], -1)
    torch.testing.assert_close(y, want)
    y.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(m.layers[0].weight.grad, torch.stack([h[0].weight.grad for h in heads]))


@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_vmap_over_an_empty_dimension(strategy):
    # The chain flattened the rows with reshape(-1, in): vmap's physical reshape of an empty
    # batch cannot infer the -1 ("cannot reshape tensor of 0 elements").
    m = blockdiag.GroupedMLP(4, [3], 2, heads=4, shared_input=False, strategy=strategy)
    assert vmap(m)(torch.randn(0, 17, 16)).shape == (0, 17, 8)
