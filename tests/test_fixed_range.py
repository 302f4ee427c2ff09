"""The deterministic one passes' fixed-point range, chosen from what the warm-up pass sums (issue 53, failure 5).

The rule (:func:`mlemlib.backends.base.calibrated_bound`) is checked on the CPU; on a GPU, OSEM with ``m``
and ``b`` on a matrix whose column sums span five decades (voxels of small sensitivity are what the safe
range ``2^20 * max(norm)`` resolved too coarsely) must stay within 1e-5 of test_osem's dense float64
contract with both deterministic kernels, and within 3x the float kernel's error.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlemlib import metrics
from mlemlib.backends.base import FIXED_MARGIN, ONEPASS_C_MAX, calibrated_bound
from mlemlib.corrections import background
from mlemlib.matrix import CSRMatrix
from mlemlib.subsets import index_labels, order, update_norms
from test_osem import M, S, _problem, dense_osem

ITERS = 10


@pytest.mark.parametrize("top,scale,bound,expected", [
    (3 << 40, 2.0**40, 1e9, FIXED_MARGIN * 3.0),  # 2^8 x the largest bp_j (3.0)
    (0, 2.0**40, 1e9, 1e9),  # the pass summed nothing: the safe range stays
    (5, 0.0, 7.0, 7.0),  # no scale recorded: the safe range stays
    (1 << 62, 1.0, 1e6, 1e6),  # never wider than the safe range
])
def test_calibrated_bound(top, scale, bound, expected):
    assert calibrated_bound(top, scale, bound) == expected


@pytest.fixture(scope="module")
def wide():
    """test_osem's problem with its columns scaled by 1 .. 1e-5 (sensitivities over five decades), rows grouped
    by subset, the subsets' update norms, b' and the dense float64 OSEM image."""
    a, g, m, b = _problem()
    col = 10.0 ** -np.linspace(0.0, 5.0, a.shape[1])
    d = a.to_scipy().astype(np.float64).multiply(col[None, :]).tocsr().astype(np.float32)
    a = CSRMatrix.from_scipy(d)
    labels = index_labels(M, S)
    rows, bounds = order(labels, subsets=S)
    ag = CSRMatrix.from_scipy(a.to_scipy()[rows])
    dg = ag.to_scipy().astype(np.float64)
    mg, bg_ = m[rows], b[rows]
    sk = np.stack([dg[bounds[k]:bounds[k + 1]].multiply(mg[bounds[k]:bounds[k + 1], None].astype(np.float64))
                   .sum(axis=0).A1 for k in range(S)])
    return {"a": ag, "g": g[rows].astype(np.float32), "bounds": bounds, "norms": update_norms(sk),
            "bg": background(mg, bg_, M), "osem": dense_osem(a, g, m, b, labels, S, ITERS)}


@pytest.mark.gpu
def test_deterministic_osem_with_m_and_b_is_as_accurate_as_the_float_pass(wide):
    from mlemlib.backends import make_backend
    from test_osem_gpu import _image

    p = wide
    err = {}
    for bp in ("onepass", "onepass_fixed", "onepass_chunked"):
        be = make_backend("cuda", p["a"], p["g"], p["norms"], None, bp=bp, subsets=p["bounds"], background=p["bg"])
        if bp != "onepass":  # each subset's range came from what its warm-up pass summed
            for k, part in enumerate(be.parts):
                assert part._fixed_bound < ONEPASS_C_MAX * float(np.nanmax(p["norms"][k])), (bp, k)
        err[bp] = metrics.relative_l2(_image(be, ITERS), p["osem"])
    for bp in ("onepass_fixed", "onepass_chunked"):
        assert err[bp] < 1e-5, err
        assert err[bp] <= max(3.0 * err["onepass"], 1e-6), err
