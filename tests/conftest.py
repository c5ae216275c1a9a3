import pytest
import torch

import blockdiag

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA is not available")),
]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _isolated_profile(tmp_path, monkeypatch):
    # No test may read or write the user's real tuning profile.
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(tmp_path / "profile.json"))
    for var in ("BLOCKDIAG_SPARSITY_THRESHOLD", "BLOCKDIAG_DENSE_MAX_GROUPS", "BLOCKDIAG_DENSE_MAX_ELEMENTS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    import torch.nn as nn

    doctest_namespace.update(torch=torch, nn=nn, blockdiag=blockdiag)
