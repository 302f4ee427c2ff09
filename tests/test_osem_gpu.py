"""OSEM subsets and the background b' = b / m on the GPU backends (issue 39; needs a CUDA GPU, several for the
multi-GPU cases).

The yardstick is test_osem's dense NumPy float64 implementation of the numerical contract; the
deterministic kernels must also give the same bits on 1 and 2 GPUs, with and without CUDA graphs, and
an all-zero background must give today's bits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlemlib import metrics
from mlemlib.backends import make_backend
from mlemlib.corrections import background
from mlemlib.formats.h5 import write_matrix_h5
from mlemlib.image import read_image
from mlemlib.matrix import CSRMatrix
from mlemlib.mlem import reconstruct
from mlemlib.problem import ModelSpec, RunSettings
from mlemlib.reorder import reorder_file
from mlemlib.subsets import index_labels, order, update_norms
from test_osem import KEPT, M, S, UNSEEN, _problem, dense_osem

pytestmark = pytest.mark.gpu

ITERS = 5
#: (fp, bp) of every family of GPU kernels: the stored-transpose pair (fused, and with the correlation as its
#: own elementwise kernel), the scatters, the one passes.
KERNELS = [("csr_vector", "csr_vector"), ("cusparse", "cusparse"), ("auto", "notrans"), ("auto", "scatter"),
           ("auto", "onepass"), ("auto", "onepass_fixed"), ("auto", "onepass_chunked"), ("auto", "auto")]
DETERMINISTIC = ("onepass_fixed", "onepass_chunked")


def _gpus() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.fixture(scope="module")
def grouped():
    """test_osem's problem with its rows grouped by subset (i mod S), the subsets' update norms, b' and the
    dense float64 images of OSEM (S subsets) and of MLEM with m and b (S = 1)."""
    a, g, m, b = _problem()
    labels = index_labels(M, S)
    rows, bounds = order(labels, subsets=S)
    ag = CSRMatrix.from_scipy(a.to_scipy()[rows])
    gg, mg, bg_ = g[rows].astype(np.float32), m[rows], b[rows]
    d = ag.to_scipy().astype(np.float64)
    sk = np.stack([(d[bounds[k]:bounds[k + 1]].multiply(mg[bounds[k]:bounds[k + 1], None].astype(np.float64))).sum(axis=0).A1
                   for k in range(S)])
    return {
        "a": ag, "g": gg, "bounds": bounds, "norms": update_norms(sk), "s": sk.sum(axis=0),
        "bg": background(mg, bg_, M),
        "osem": dense_osem(a, g, m, b, labels, S, ITERS),
        "mlem": dense_osem(a, g, m, b, np.zeros(M, dtype=np.int64), 1, ITERS),
    }


def _image(be, iters=ITERS):
    try:
        f = be.initial_image()
        for _ in range(iters):
            f = be.iterate(f)
        return be.to_host(f)
    finally:
        if hasattr(be, "close"):
            be.close()


@pytest.mark.parametrize("fp,bp", KERNELS)
def test_osem_with_m_and_b_matches_the_dense_contract_on_1_and_2_gpus(grouped, fp, bp):
    p = grouped
    images = {}
    for gpus in sorted({1, min(2, _gpus())}):
        be = make_backend("cuda", p["a"], p["g"], p["norms"], None, fp=fp, bp=bp, gpus=gpus,
                          subsets=p["bounds"], background=p["bg"])
        assert be.describe()["subsets"] == S
        images[gpus] = img = _image(be)
        assert metrics.relative_l2(img, p["osem"]) < 1e-5, (fp, bp, gpus)
        assert img[UNSEEN] == 0 and img[KEPT] > 0
    if bp in DETERMINISTIC and len(images) == 2:
        assert np.array_equal(images[1], images[2]), bp


@pytest.mark.parametrize("fp,bp", KERNELS)
def test_mlem_with_m_and_b_matches_the_dense_contract(grouped, fp, bp):
    p = grouped
    t = CSRMatrix.from_scipy(p["a"].to_scipy().T.tocsr())
    for gpus, layout in [(1, "local"), (min(2, _gpus()), "local"), (min(2, _gpus()), "thesis")]:
        if layout == "thesis" and bp not in ("csr_vector", "cusparse"):
            continue
        be = make_backend("cuda", p["a"], p["g"], p["s"], t, fp=fp, bp=bp, gpus=gpus, layout=layout,
                          background=p["bg"])
        assert metrics.relative_l2(_image(be), p["mlem"]) < 1e-5, (fp, bp, gpus, layout)


@pytest.mark.parametrize("fp,bp", [("csr_vector", "csr_vector"), ("auto", "onepass_fixed"), ("auto", "onepass_chunked")])
def test_an_all_zero_background_and_one_subset_give_todays_bits(grouped, fp, bp):
    p = grouped
    norm = p["a"].to_scipy().astype(np.float64).sum(axis=0).A1
    t = CSRMatrix.from_scipy(p["a"].to_scipy().T.tocsr())
    today = _image(make_backend("cuda", p["a"], p["g"], norm, t, fp=fp, bp=bp))
    zero = _image(make_backend("cuda", p["a"], p["g"], norm[None, :], t, fp=fp, bp=bp,
                               background=np.zeros(M, dtype=np.float32), subsets=np.array([0, M])))
    assert np.array_equal(zero, today)


@pytest.mark.parametrize("bp", DETERMINISTIC)
def test_osem_pass_graph_gives_the_eager_bits_on_1_and_2_gpus(grouped, bp):
    """The whole pass as one graph per GPU (all-reduces included on 2 GPUs, none on 1) gives the bits of
    the subsets launched one by one, and switching between the two on one backend keeps them."""
    p = grouped
    for gpus in sorted({1, min(2, _gpus())}):
        eager = _image(make_backend("cuda", p["a"], p["g"], p["norms"], None, bp=bp, gpus=gpus,
                                    subsets=p["bounds"], background=p["bg"]))
        be = make_backend("cuda", p["a"], p["g"], p["norms"], None, bp=bp, gpus=gpus, subsets=p["bounds"],
                          background=p["bg"], graph=True)
        assert be.describe()["graph"] is True
        try:
            f = be.initial_image()
            for k in range(ITERS):
                be.use_graph(k % 2 == 0)  # graph, eager, graph, ...
                f = be.iterate(f)
                assert be.last_step_times()["iteration"] > 0
            assert np.array_equal(be.to_host(f), eager), (bp, gpus)
        finally:
            be.close()


@pytest.mark.parametrize("subsets", [True, False])
def test_graph_overflow_is_redone_as_the_eager_path_does(grouped, caplog, subsets):
    """An overflow inside a replayed graph (the range of subset 2, or of the one MLEM backend, made 2^40 times too
    small) puts back the image the replay started from, redoes the pass or iteration kernel by kernel with the
    range raised (retrying as the eager path does) and captures the graphs again: the images are the eager
    backend's, bit for bit, from the same too-small range."""
    import logging

    from mlemlib.backends.base import FIXED_RETRY_FACTOR
    from mlemlib.backends.nccl import NcclBackend

    p = grouped
    images, logs = {}, {}
    for graph in (True, False):
        if subsets:
            be = make_backend("cuda", p["a"], p["g"], p["norms"], None, bp="onepass_fixed", gpus=1,
                              subsets=p["bounds"], graph=graph)
        else:
            be = NcclBackend(p["a"], p["g"], p["s"], gpus=1, layout="local", bp="onepass_fixed", graph=graph)
        try:
            part = be.parts[2] if subsets else be
            part._fixed_bound /= FIXED_RETRY_FACTOR**2
            if graph:  # capture again with the small range
                be.use_graph(False)
                if subsets:
                    be._graphs = None
                else:
                    be.shards[0].graph = None
                be.use_graph(True)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="mlemlib.backends"):
                f = be.initial_image()
                for _ in range(3):
                    f = be.iterate(f)
            images[graph], logs[graph] = be.to_host(f), caplog.text
            assert be.graph == graph
        finally:
            be.close()
    want = "overflow inside the pass's CUDA graph in subset(s) 2" if subsets else "overflow inside the CUDA graph"
    assert want in logs[True] and "inside" not in logs[False]
    assert np.array_equal(images[True], images[False])


def test_osem_steps_and_pass_time_are_reported(grouped):
    """By default (graph None: auto) an OSEM pass is one graph per GPU, on one GPU too, and times only the whole
    pass; launched subset by subset it times the steps."""
    p = grouped
    be = make_backend("cuda", p["a"], p["g"], p["norms"], None, bp="onepass_fixed", gpus=1, subsets=p["bounds"])
    try:
        assert be.graph
        f = be.iterate(be.initial_image())
        assert set(be.last_step_times()) == {"iteration"} and be.last_step_times()["iteration"] > 0
        be.use_graph(False)
        f = be.iterate(f)
        times = be.last_step_times()
        assert times["iteration"] > 0 and times["bp"] > 0 and times["iteration"] >= times["bp"]
        assert be.to_host(f).shape == (p["a"].shape[1],)
    finally:
        be.close()


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("fmt", ["csr", "compressed"])
def test_reconstruct_runs_osem_with_factor_files_on_the_gpu(tmp_path, fmt, graph):
    """Through ``reconstruct`` (which closes its backend: a pass graph that captured NCCL calls must go before the
    communicator), subset by subset (graph False) and as one graph per pass (True, also the default), on 1 and
    2 GPUs."""
    a, g, m, b = _problem()
    from mlemlib.formats import convert

    write_matrix_h5(tmp_path / "a.h5", a)
    src = tmp_path / "a.h5"
    if fmt == "compressed":
        convert(src, tmp_path / "c.h5", fmt="compressed")
        src = tmp_path / "c.h5"
    reorder_file(src, tmp_path / "r.h5", "none", subsets=S)
    m.tofile(tmp_path / "m.f32")
    b.tofile(tmp_path / "b.f32")
    expected = dense_osem(a, g, m, b, index_labels(M, S), S, ITERS)
    for gpus in sorted({1, min(2, _gpus())}):
        out = tmp_path / f"img-{gpus}.h5"
        reconstruct(ModelSpec(tmp_path / "r.h5", g, subsets=S, multiplicative=tmp_path / "m.f32",
                              additive=tmp_path / "b.f32"),
                    RunSettings(ITERS, checkpoint_every=0, backend="cuda", graph=graph, gpus=gpus), out)
        assert metrics.relative_l2(read_image(out)[0], expected) < 1e-5, (fmt, gpus)


_FRESH = r"""
import sys
from pathlib import Path
import numpy as np
from mlemlib import metrics
from mlemlib.formats import convert
from mlemlib.formats.h5 import write_matrix_h5
from mlemlib.image import read_image
from mlemlib.mlem import reconstruct
from mlemlib.problem import ModelSpec, RunSettings
from mlemlib.subsets import index_labels
from test_osem import _problem, dense_osem

tmp, fmt, bp = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
a, g, m, b = _problem()
write_matrix_h5(tmp / "a.h5", a)
src = tmp / "a.h5"
if fmt != "csr":
    convert(src, tmp / f"{fmt}.h5", fmt=fmt)
    src = tmp / f"{fmt}.h5"
reconstruct(ModelSpec(src, g), RunSettings(5, checkpoint_every=0, backend="cuda", gpus=2, bp=bp), tmp / "img.h5")
want = dense_osem(a, g, np.ones(len(g)), np.zeros(len(g)), index_labels(len(g), 1), 1, 5)
err = metrics.relative_l2(read_image(tmp / "img.h5")[0], want)
print("error", err)
sys.exit(0 if err < 1e-5 else 3)
"""


@pytest.mark.parametrize(("fmt", "bp"), [("csr", "csr_vector"), ("compressed", "onepass_fixed")])
def test_a_fresh_process_runs_on_two_gpus_first(tmp_path, fmt, bp):
    """A process whose first work is a run on 2 GPUs: the loading threads (one per GPU) are the first to reach
    cuSPARSE's modules (each GPU transposes its CSR rows) or the page-locked staging buffers (a compressed matrix
    read from its file); neither may fail there (Python's import lock, CuPy's lazily loaded cupyx)."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _FRESH, str(tmp_path), fmt, bp], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
