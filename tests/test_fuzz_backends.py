"""Every backend (and ``auto``) on hypothesis-drawn shapes, strides and operand kinds.

Block sizes 1..70, column slices at offsets, column-major, negative and conjugate bits,
expanded (stride 0) and overlapping rows, storage offsets and tensor subclasses, each compared
with the float64 loop reference for outputs and the gradients of input, weight and bias
(``tests/_strided.py``). The compiled kernels get more examples in test_native_hardening.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiag.backends import get

from _params import backends_and_auto, require_backend
from _strided import B_KINDS, GY_KINDS, W_KINDS, X_KINDS, check_against_reference


# What each drawn case varies besides the dtype: the sizes, each operand's kind, the seed.
DRAWN = dict(
    n=st.integers(1, 9), g=st.integers(1, 3), i=st.integers(1, 70), o=st.integers(1, 70),
    xk=st.sampled_from(X_KINDS), wk=st.sampled_from(W_KINDS), bk=st.sampled_from(B_KINDS),
    gk=st.sampled_from(GY_KINDS), seed=st.integers(0, 2**16),
)
DRAWING = settings(max_examples=12, deadline=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("name", backends_and_auto())
@DRAWING
@given(dtype=st.sampled_from([torch.float32, torch.float64]), **DRAWN)
def test_every_backend_against_the_float64_reference(name, dtype, n, g, i, o, xk, wk, bk, gk, seed):
    require_backend(name)
    check_against_reference(name, dtype, n, g, i, o, xk, wk, bk, gk, seed)


# The half dtypes on the backends that compute them in float32 (Backend.upcasts: simd on CPU)
# and on auto, which ranks those first: the casts must see every operand kind as the kernels
# do. Complex views have no bfloat16 dtype, so conj().imag is drawn in float16 only.
UPCASTING = [p for p in backends_and_auto() if p.values[0] == "auto" or get(p.values[0]).upcasts.get("cpu")]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")  # float16 conj().imag
@pytest.mark.parametrize("name", UPCASTING)
@DRAWING
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), **DRAWN)
def test_half_dtypes_against_the_float64_reference(name, dtype, n, g, i, o, xk, wk, bk, gk, seed):
    require_backend(name)
    if xk == "conj().imag":
        dtype = torch.float16
    check_against_reference(name, dtype, n, g, i, o, xk, wk, bk, gk, seed)


# Twelve drawn examples rarely meet a given kind of a given operand (9 x 6 x 4 x 6 kinds), so
# each kind is also checked once, deterministically, with the other operands plain: a backend
# that ignores the negative bit of a weight failed CI only on the run whose draw hit it.
ONE_KIND = ([("x", k) for k in X_KINDS[1:]] + [("w", k) for k in W_KINDS[1:]]
            + [("b", k) for k in B_KINDS[1:]] + [("gy", k) for k in GY_KINDS[1:]])


@pytest.mark.parametrize("operand,kind", ONE_KIND, ids=[f"{o}={k}" for o, k in ONE_KIND])
@pytest.mark.parametrize("name", backends_and_auto())
def test_every_operand_kind_on_every_backend(name, operand, kind):
    require_backend(name)
    kinds = {"x": "plain", "w": "plain", "b": "plain", "gy": "plain", operand: kind}
    for n, g, i, o in [(1, 1, 1, 1), (5, 3, 4, 6)]:
        check_against_reference(name, torch.float32, n, g, i, o,
                                kinds["x"], kinds["w"], kinds["b"], kinds["gy"], seed=n)
