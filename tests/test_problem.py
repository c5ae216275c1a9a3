"""``Problem``, the chooser's key and every backend's contract, refuses malformed fields."""

from __future__ import annotations

import pytest
import torch

from blockdiag import BlockDiagError, Problem, choose, grouped_linear


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"groups": 0}, r"Problem: groups must be an int >= 1, got 0", id="zero-groups"),
        pytest.param({"batch": -1}, r"Problem: batch must be an int >= 0, got -1", id="negative-batch"),
        pytest.param({"block_in": 2.0}, r"Problem: block_in must be an int >= 0, got 2.0", id="float-size"),
        pytest.param({"block_out": True}, r"Problem: block_out must be an int >= 0, got True", id="bool-size"),
        pytest.param({"dtype": "float32"}, r"Problem: dtype must be a torch.dtype, got 'float32'", id="dtype-name"),
        pytest.param({"device": 0}, r"Problem: device must be a device type such as 'cpu', got 0", id="device-index"),
    ],
)
def test_malformed_fields_are_refused(kwargs, match):
    fields = {"batch": 8, "groups": 4, "block_in": 4, "block_out": 4, **kwargs}
    with pytest.raises(BlockDiagError, match=match):
        Problem(**fields)


def test_a_torch_device_is_keyed_by_its_type():
    p = Problem(8, 4, 4, 4, device=torch.device("cpu"))
    assert p.device == "cpu" and p == Problem(8, 4, 4, 4) and choose(p) is choose(Problem(8, 4, 4, 4))


@pytest.mark.parametrize("name", ["cuda:1", "cuda:0", "cpu:0"])
def test_a_device_string_with_an_index_is_keyed_by_its_type(name):
    # str(tensor.device) on a second GPU is "cuda:1": the same problem as "cuda" (no GPU needed).
    p = Problem(8, 4, 4, 4, device=name)
    assert p.device == name.split(":")[0] and p == Problem(8, 4, 4, 4, device=torch.device(name))
    assert choose(p).backend


def test_an_unknown_device_string_with_an_index_is_refused():
    with pytest.raises(BlockDiagError, match=r"Problem: device must be a device type such as 'cpu', got 'gpu:1'"):
        Problem(8, 4, 4, 4, device="gpu:1")


def test_zero_groups_from_the_operands_is_named():
    with pytest.raises(BlockDiagError, match=r"grouped_linear: weight must hold at least one group, got shape \(0, 2, 3\)"):
        grouped_linear(torch.randn(5, 0), torch.randn(0, 2, 3))


def test_operands_that_are_not_tensors_are_named():
    with pytest.raises(BlockDiagError, match=r"grouped_linear: input must be a torch.Tensor, got list"):
        grouped_linear([[1.0] * 6], torch.randn(2, 3, 3))
    with pytest.raises(BlockDiagError, match=r"grouped_linear: weight must be a torch.Tensor, got list"):
        grouped_linear(torch.randn(1, 6), [[1.0]])
    with pytest.raises(BlockDiagError, match=r"grouped_linear: bias must be a torch.Tensor, got float"):
        grouped_linear(torch.randn(1, 6), torch.randn(2, 3, 3), 0.5)


def test_feature_counts_must_be_ints():
    from blockdiag import GroupedLinear

    with pytest.raises(BlockDiagError, match=r"in_features and out_features must be positive ints, got in_features=6.0, out_features=6"):
        GroupedLinear(6.0, 6, 2)
