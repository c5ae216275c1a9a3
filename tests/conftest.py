"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest

from blockdiag import GroupedMLP


@pytest.fixture
def table_prefers_chain(monkeypatch):
    """The measured table says the chain is faster (whatever the machine's table says)."""
    def choice(self, x):
        return True, "test: chain measured faster", 1.0, 2.0, self._layer_plans(x)

    monkeypatch.setattr(GroupedMLP, "_measured_choice", choice)
