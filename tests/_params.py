"""Shared pytest parameters: devices (CUDA skipped cleanly without it) and dtypes, with readable ids.

Imported by the test modules as ``from _params import ...`` (pytest puts ``tests/`` on the path).
"""

import pytest
import torch

CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="CUDA is not available")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA_MARKS)]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]
