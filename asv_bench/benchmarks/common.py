"""Shared parameters and helpers of the blockdiag benchmarks.

Parameter lists must not depend on the blockdiag version installed: asv discovers the
benchmarks once (on the newest commit) and then addresses each parameter combination by its
index when it benchmarks older commits, so a list that grew with the registry would shift the
indices. ``KNOWN_BACKENDS`` therefore lists every backend name any commit registers;
``.ci/asv_check.sh`` fails when the registry holds a name missing here. A backend that a commit
lacks, or that cannot run a shape there, raises ``NotImplementedError`` in ``setup`` (shown as
n/a), so one suite benchmarks every commit.

``BLOCKDIAG_ASV_GRID=tiny`` shrinks every shape grid to one small point (CI smoke runs only:
never mix its results with the real ones).
"""

import os
import warnings

import torch

import blockdiag
from blockdiag import BlockDiagError

# torch announces its beta sparse layouts once per process; it would flood every log.
warnings.filterwarnings("ignore", "Sparse (CSR|BSR|CSC|BSC) tensor support is in beta state", UserWarning)

KNOWN_BACKENDS = ("loop", "dense", "bmm", "conv", "csr", "bsr", "torch_sparse", "grouped_mm", "bmm_fm", "bmm_fm_loop", "bmm_fm_bmm", "mkl_batch", "simd")
TINY = os.environ.get("BLOCKDIAG_ASV_GRID", "") == "tiny"

# Every known name first (stable indices), then any name only this installation registers.
BACKENDS = list(KNOWN_BACKENDS) + [b.name for b in blockdiag.backends() if b.name not in KNOWN_BACKENDS]

# The GPU parameter exists only where CUDA does (results are stored per machine).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def grid(full, tiny):
    """``full`` normally, ``tiny`` under ``BLOCKDIAG_ASV_GRID=tiny``."""
    return tiny if TINY else full


def parse_block(block: str) -> tuple[int, int]:
    """``"150x10"`` (in x out) -> ``(150, 10)``."""
    i, o = block.split("x")
    return int(i), int(o)


def sync(device: str) -> None:
    """Wait for queued kernels so a timing covers the work, not just its launch."""
    if device == "cuda":
        torch.cuda.synchronize()


def require_backend(name: str) -> None:
    """Raise ``NotImplementedError`` when ``name`` is not registered or cannot run here."""
    info = {b.name: b for b in blockdiag.backends()}
    if name not in info:
        raise NotImplementedError(f"backend {name!r} is not registered in this commit")
    if not info[name].available:
        raise NotImplementedError(f"backend {name!r} is unavailable here: {info[name].reason}")


def require_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise NotImplementedError("CUDA is not available")


def try_run(fn):
    """Run ``fn()`` once (warm-up); a backend declining the problem becomes ``NotImplementedError``."""
    try:
        return fn()
    except BlockDiagError as e:
        raise NotImplementedError(str(e)) from None
