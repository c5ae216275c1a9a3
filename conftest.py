"""Root conftest: applies to the test suite and to the doctests in blockdiag/."""

import pytest
import torch
import torch.nn as nn

import blockdiag


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _isolated_profile(tmp_path, monkeypatch):
    # No test or doctest may read or write the user's real tuning profile or settings.
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(tmp_path / "profile.json"))
    # Every setting's variable, from the settings' own table, so that a new one is covered too
    # (a BLOCKDIAG_DOUBLE_BACKWARD=1 in the developer's shell failed the chooser's tests).
    for var, _ in blockdiag.settings._ENV.values():
        if var != "BLOCKDIAG_PROFILE":
            monkeypatch.delenv(var, raising=False)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(torch=torch, nn=nn, blockdiag=blockdiag)
