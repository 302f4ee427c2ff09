"""Multi-GPU backend and multi-process bootstrap (mlemlib.backends.nccl, mlemlib.dist.mpi).

The host-side logic (kernel resolution, plans, row slicing, rank detection,
NCCL-id exchange, the local launcher) runs in CI without a GPU; the backend
itself is tested under the ``gpu`` marker (needs CuPy with NCCL; two GPUs for
the multi-GPU cases).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib import partition
from mlemlib.backends import make_backend
from mlemlib.dist import mpi as M
from mlemlib.backends import _cuda_kernels as ck
from mlemlib.backends import nccl as N
from mlemlib import registry
from mlemlib.errors import ConfigError, DeviceError, MatrixFormatError
from mlemlib.matrix import CSRMatrix


def _matrix(rng, m=60, n=40, density=0.2) -> CSRMatrix:
    a = sp.random(m, n, density=density, random_state=np.random.RandomState(int(rng.integers(1 << 30))), format="csr")
    a.data = a.data.astype(np.float32) + np.float32(0.1)
    return CSRMatrix.from_scipy(a)


def _transpose(a: CSRMatrix) -> CSRMatrix:
    return CSRMatrix.from_scipy(a.to_scipy().T.tocsr())


# --------------------------------------------------------------------------- kernels and plans


def resolve_kernels(fp, bp, layout):
    """The several-GPU backend's decision without a chunk sample: (fp, bp, deterministic)."""
    c = registry.decide("cuda", fp, bp, gpus=2, layout=layout, transpose_available=True)
    return c.fp, c.bp, c.deterministic


@pytest.mark.parametrize(
    "fp, bp, layout, expected",
    [
        ("auto", "auto", "local", ("csr_vector", "csr_vector", True)),
        ("auto", "auto", "thesis", ("csr_vector", "csr_vector", True)),
        ("csr_scalar", "scatter", "local", ("csr_scalar", "scatter", False)),
        ("merge", "csr_vector", "thesis", ("merge", "csr_vector", False)),
        ("auto", "notrans", "local", ("csr_vector", "notrans", False)),  # settled on the first part
    ],
)
def test_resolve_kernels(fp, bp, layout, expected):
    assert resolve_kernels(fp, bp, layout) == expected


def test_resolve_kernels_rejects():
    with pytest.raises(ConfigError, match="unknown layout"):
        resolve_kernels("auto", "auto", "ring")
    with pytest.raises(ConfigError, match="'scatter_smem' of backend cuda does not run on 2 GPUs in the thesis layout"):
        resolve_kernels("auto", "scatter_smem", "thesis")
    with pytest.raises(ConfigError, match="'onepass' of backend cuda does not run on 2 GPUs in the thesis layout"):
        resolve_kernels("auto", "onepass", "thesis")
    with pytest.raises(ConfigError, match="unknown forward-projection kernel"):
        resolve_kernels("fast", "auto", "local")


def test_build_plan_in_memory_matches_the_partition_stage(rng):
    a = _matrix(rng)
    at = _transpose(a)
    plan = N.build_plan(a, at, 3, None, "thesis")
    expected = partition.make_plan(a.indptr, at.indptr, 3, a.shape)
    assert plan["rows"] == expected["rows"] and plan["transpose_rows"] == expected["transpose_rows"]
    # rows cover [0, m) contiguously and the nnz per part add up
    assert plan["rows"][0][0] == 0 and plan["rows"][-1][1] == a.shape[0]
    assert all(plan["rows"][k][1] == plan["rows"][k + 1][0] for k in range(2))
    assert sum(plan["nnz_per_part"]) == a.nnz


def test_build_plan_checks_a_given_plan(rng):
    a = _matrix(rng)
    plan = partition.make_plan(a.indptr, None, 2, a.shape)
    with pytest.raises(ConfigError, match="plan has 2 parts but the run uses 4 GPUs"):
        N.build_plan(a, None, 4, plan, "local")
    other = _matrix(rng, m=61)
    with pytest.raises(MatrixFormatError, match="plan is for a"):
        N.build_plan(other, None, 2, plan, "local")
    with pytest.raises(ConfigError, match="layout=thesis needs the transpose"):
        N.build_plan(a, None, 2, plan, "thesis")
    assert N.build_plan(a, None, 2, plan, "local")["rows"] == plan["rows"]


def test_build_plan_reads_the_partition_files(rng, tmp_path):
    from mlemlib.formats.h5 import MatrixH5, write_matrix_h5

    a = _matrix(rng)
    write_matrix_h5(tmp_path / "matrix.h5", a)
    write_matrix_h5(tmp_path / "transpose.h5", _transpose(a))
    partition.partition_file(tmp_path / "matrix.h5", tmp_path / "transpose.h5", 3, tmp_path / "parts-3", local_transpose=True)
    with MatrixH5(tmp_path / "matrix.h5") as mat:
        plan = N.build_plan(mat, None, 3, tmp_path / "parts-3", "thesis")
    assert len(plan["local_transpose"]) == 3 and plan["transpose_rows"][-1][1] == a.shape[1]


def test_slice_rows_host_equals_scipy(rng):
    a = _matrix(rng)
    ref = a.to_scipy()
    for r0, r1 in ((0, 10), (13, 40), (59, 60), (30, 30)):
        b = ck.slice_rows_host(a, r0, r1)
        assert b.indptr[0] == 0 and b.shape == (r1 - r0, a.shape[1])
        assert (b.to_scipy() != ref[r0:r1]).nnz == 0


def test_aligned_pad_keeps_offsets_modulo_4():
    for base in range(0, 17):
        pad = ck.aligned_pad(base)
        assert 0 <= pad < ck.ALIGN and (base - pad) % ck.ALIGN == 0


# --------------------------------------------------------------------------- ranks and the NCCL id


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"MLEM_RANK": "1", "MLEM_WORLD_SIZE": "4", "MLEM_LOCAL_RANK": "1"}, (1, 4, 1)),
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (5, 8, 1)),
        ({"PMI_RANK": "2", "PMI_SIZE": "3"}, (2, 3, 2)),  # no local rank: the rank
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3"}, (3, 4, 3)),
        # MLEM_* wins over a surrounding SLURM allocation
        ({"MLEM_RANK": "0", "MLEM_WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"}, (0, 2, 0)),
    ],
)
def test_detect_rank(env, expected):
    info = M.detect_rank(env)
    assert (info.rank, info.size, info.local_rank) == expected


def test_detect_rank_outside_a_launcher_and_bad_values():
    assert M.detect_rank({"SLURM_JOB_ID": "1"}) is None
    with pytest.raises(ConfigError, match="expected an integer"):
        M.detect_rank({"MLEM_RANK": "x", "MLEM_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match=r"rank 2 is not in \[0, 2\)"):
        M.detect_rank({"MLEM_RANK": "2", "MLEM_WORLD_SIZE": "2"})


def test_default_token():
    assert M.default_token({"MLEM_RUN_ID": "abc", "SLURM_JOB_ID": "9"}) == "abc"
    assert M.default_token({"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "2"}) == "9.2"
    assert M.default_token({}) == ""


def test_unique_id_value_forms():
    raw = bytes(range(250, 256)) + bytes(range(10))
    assert M.unique_id_value(raw) == raw
    assert M.unique_id_value(list(raw)) == raw
    signed = [b - 256 if b > 127 else b for b in raw]  # older CuPy: signed chars
    assert M.unique_id_value(signed) == raw


def test_exchange_id_file_all_ranks_get_rank0s_id(tmp_path):
    path = tmp_path / "nccl-id.json"
    uid = bytes(np.random.default_rng(3).integers(0, 256, 128, dtype=np.uint8))
    got: dict[int, list[int]] = {}

    def rank(r):
        got[r] = M.exchange_id_file(path, r, lambda: uid, token="run-1", timeout=10)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (3, 1, 2)]  # readers start first
    for t in threads:
        t.start()
    time.sleep(0.2)
    rank(0)
    for t in threads:
        t.join(10)
    assert set(got) == {0, 1, 2, 3}
    assert all(M.unique_id_value(v) == uid for v in got.values())


def test_exchange_id_file_ignores_a_stale_file_and_times_out(tmp_path):
    path = tmp_path / "nccl-id.json"
    path.write_text(json.dumps({"token": "old-run", "uid": [1] * 128}))
    with pytest.raises(DeviceError, match="waited 0.3 s for rank 0"):
        M.exchange_id_file(path, 1, lambda: b"", token="new-run", timeout=0.3)
    fresh = bytes(range(128))
    result = {}
    t = threading.Thread(target=lambda: result.update(v=M.exchange_id_file(path, 1, None, token="new-run", timeout=10)))
    t.start()
    time.sleep(0.2)
    assert M.exchange_id_file(path, 0, lambda: fresh, token="new-run") == list(fresh)
    t.join(10)
    assert M.unique_id_value(result["v"]) == fresh


RANK_PROBE = (
    "import json, os, sys\n"
    "keys = ['MLEM_RANK', 'MLEM_WORLD_SIZE', 'MLEM_LOCAL_RANK', 'MLEM_LAUNCHER', 'MLEM_NCCL_ID_FILE', 'MLEM_RUN_ID', "
    "'CUDA_VISIBLE_DEVICES']\n"
    "open(os.path.join(sys.argv[1], 'rank-' + os.environ['MLEM_RANK'] + '.json'), 'w').write("
    "json.dumps({k: os.environ.get(k) for k in keys}))\n"
)


def test_launch_local_gives_each_rank_its_identity(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="3,1,2")
    codes = M.launch_local(3, [sys.executable, "-c", RANK_PROBE, str(tmp_path)], env=env, id_dir=tmp_path, timeout=60)
    assert codes == [0, 0, 0]
    recs = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    assert [r["MLEM_RANK"] for r in recs] == ["0", "1", "2"]
    assert {r["MLEM_WORLD_SIZE"] for r in recs} == {"3"}
    assert [r["CUDA_VISIBLE_DEVICES"] for r in recs] == ["3", "1", "2"]  # one GPU each, from the parent's list
    assert {r["MLEM_LOCAL_RANK"] for r in recs} == {"0"}
    assert len({r["MLEM_RUN_ID"] for r in recs}) == 1 and len({r["MLEM_NCCL_ID_FILE"] for r in recs}) == 1
    assert not list(tmp_path.glob("mlem-nccl-*.json"))  # the id file is removed


def test_launch_local_stops_the_others_when_one_rank_fails(tmp_path):
    script = "import os, sys, time\nif os.environ['MLEM_RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n"
    t0 = time.monotonic()
    codes = M.launch_local(3, [sys.executable, "-c", script], id_dir=tmp_path, one_gpu_each=False, timeout=60)
    assert time.monotonic() - t0 < 30
    assert codes[1] == 3 and codes[0] != 0 and codes[2] != 0


def test_launch_local_refuses_more_ranks_than_gpus(tmp_path):
    with pytest.raises(ConfigError, match="3 ranks but only 2 GPUs"):
        M.launch_local(3, ["true"], env={"CUDA_VISIBLE_DEVICES": "0,1"}, id_dir=tmp_path)


def test_mpi_module_runs_as_a_launcher(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlemlib.dist.mpi", "-n", "2", "--", sys.executable, "-c", RANK_PROBE, str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, CUDA_VISIBLE_DEVICES="0,1"),
    )
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]


def test_make_backend_rejects_unknown_launcher(rng):
    with pytest.raises(ConfigError, match="unknown launcher 'slurm'"):
        make_backend("cuda", _matrix(rng), None, None, gpus=2, launcher="slurm")


def test_make_backend_refuses_a_local_back_projection_without_part_files_before_any_work():
    """Several GPUs in the local layout, a named back projection on A^T, a compressed matrix and a plan without
    part files: one line naming the plan before any GPU work (the GPUs cannot transpose a compressed block); a
    CSR matrix, bp auto, a one pass, the thesis layout, a kernel that does not read the format (refused by its own
    check) or a plan with part files pass this check."""
    import types

    bp = "delta_vector"
    compressed = types.SimpleNamespace(format="compressed", shape=(60, 40))
    with pytest.raises(ConfigError, match=r"^plan: bp=" + bp + " on a compressed matrix in the local layout .*part files"):
        make_backend("cuda", compressed, None, None, gpus=2, bp=bp, layout="local")
    with pytest.raises(ConfigError, match="part files"):
        make_backend("cuda", compressed, None, None, gpus=1, bp=bp, graph=True)  # the several-GPU backend on one
    from mlemlib.backends import _check_part_files

    for matrix, bp_, layout, plan in [(types.SimpleNamespace(format="csr"), "csr_vector", "local", None),
                                      (compressed, "csr_vector", "local", None),  # not its format: refused elsewhere
                                      (compressed, "auto", "local", None), (compressed, "onepass_fixed", "local", None),
                                      (compressed, bp, "thesis", None),
                                      (compressed, bp, "local", {"local_transpose": ["part-0.h5", "part-1.h5"]})]:
        _check_part_files(matrix, bp_, layout, plan)  # no refusal
    # one GPU launching its kernels: a stored transpose, before any work
    with pytest.raises(ConfigError, match=r"^transpose: bp=delta_vector on a compressed matrix needs a stored"):
        make_backend("cuda", compressed, None, None, gpus=1, bp=bp)


# --------------------------------------------------------------------------- on GPUs


def _gpus() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _problem():
    from mlemlib.bench import tor_matrix

    a = tor_matrix(24, 24, 3, 24, 30)
    at = _transpose(a)
    x = np.random.default_rng(5).uniform(0.5, 1.5, a.shape[1]).astype(np.float32)
    g = np.rint(a.to_scipy() @ x * 10).astype(np.float32)
    norm = np.asarray(a.to_scipy().sum(axis=0), dtype=np.float64).ravel()
    return a, at, g, norm


def _image(be, iters=15):
    f = be.initial_image()
    for _ in range(iters):
        f = be.iterate(f)
    return be.to_host(f)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["local", "thesis"])
def test_nccl_backend_matches_one_gpu(layout):
    from mlemlib.backends.cuda import CudaBackend

    p = min(_gpus(), 4)
    a, at, g, norm = _problem()
    ref = _image(CudaBackend(a, g, norm, transpose=at, fp="csr_vector", bp="csr_vector"))
    with N.NcclBackend(a, g, norm, transpose=at, gpus=p, layout=layout, graph=False) as be:
        img = _image(be)
        again = _image(be)
        be.use_graph(True)
        graphed = _image(be)
        steps = be.last_step_times()
    assert np.array_equal(img, again)  # deterministic run after run
    assert np.array_equal(img, graphed)  # the graph replays the same launches
    assert "iteration" in steps
    rel = np.linalg.norm(img.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64))
    assert rel < 1e-6
    if layout == "thesis":  # sums with zeros only, rows summed as on one GPU
        assert np.array_equal(img, ref)


@pytest.mark.gpu
def test_nccl_one_pass_describes_itself_as_one_pass():
    """describe() says onepass, so timings.json counts A once an iteration (2-GPU Matrix 3 runs had counted it twice)."""
    a, _, g, norm = _problem()
    with N.NcclBackend(a, g, norm, gpus=min(_gpus(), 2), layout="local", bp="onepass_fixed", graph=False) as be:
        be.iterate(be.initial_image())
        desc = be.describe()
    assert desc["onepass"] and desc["transpose"] == "none" and desc["steps"] == ["bp", "allreduce", "update"]
    with N.NcclBackend(a, g, norm, gpus=1, layout="local", fp="csr_vector", bp="scatter") as be:
        assert not be.describe()["onepass"]


@pytest.mark.gpu
def test_nccl_backend_step_times_and_describe():
    a, at, g, norm = _problem()
    with N.NcclBackend(a, g, norm, transpose=at, gpus=min(_gpus(), 2), layout="local", graph=False) as be:
        be.iterate(be.initial_image())
        times = be.last_step_times()
        desc = be.describe()
    assert {"fp", "bp", "allreduce", "update", "iteration"} <= set(times)
    assert all(v >= 0 for v in times.values())
    assert desc["backend"] == "cuda-nccl" and desc["layout"] == "local" and desc["deterministic"]


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_nccl_backend_pipelines_its_step_times(graph):
    """The pair queues iteration k+1 before iteration k's times are read (previous_step_times: k's events, kept
    in the other of two sets), with the same image bits as reading each iteration's times at once; the
    deterministic one pass launched kernel by kernel reads its overflow flags every iteration and does not
    pipeline."""
    from mlemlib.backends.base import timed_iterations

    a, at, g, norm = _problem()
    with N.NcclBackend(a, g, norm, transpose=at, gpus=min(_gpus(), 2), layout="local", graph=graph) as be:
        assert be.pipelines
        assert be.previous_step_times() is None  # none queued yet
        f = be.initial_image()
        reads = []
        for _, f, ready in timed_iterations(be, f, 1, 6):
            reads += ready
        piped = be.to_host(f)
        plain = _image(be, 6)
    assert [k for k, _ in reads] == [1, 2, 3, 4, 5, 6]
    assert all(t["iteration"] > 0 and t["iteration"] >= max((v for s, v in t.items() if s != "iteration"), default=0.0)
               for _, t in reads)
    assert np.array_equal(piped, plain)
    with N.NcclBackend(a, g, norm, gpus=1, layout="local", bp="onepass_fixed", graph=graph) as one:
        assert one.pipelines == graph  # replayed, its flags are read one iteration late


@pytest.mark.gpu
def test_fixed_point_replays_are_checked_one_iteration_late():
    """A fixed-point one pass replays two graphs in turn and reads each replay's overflow flag while the next
    one runs, the last one's before its image is read. An overflow found either way (iteration 1's, while
    iteration 2 runs; iteration 3's, the last, by to_host) is redone kernel by kernel with the range raised,
    the replay after it too: the images are the eager backend's, bit for bit, from the same too-small ranges."""
    from mlemlib.backends.base import FIXED_RETRY_FACTOR

    a, _, g, norm = _problem()
    images = {}
    for graph in (False, True):
        with N.NcclBackend(a, g, norm, gpus=min(_gpus(), 2), layout="local", bp="onepass_fixed", graph=graph) as be:
            assert be.pipelines == graph
            f = be.initial_image()
            for k in range(4):
                if k in (1, 3):  # this iteration's range 2^40 times too small: it overflows
                    be._fixed_bound /= FIXED_RETRY_FACTOR**2
                    if graph:  # capture again with the small range
                        be.use_graph(False)
                        be.shards[0].graph = None
                        be.use_graph(True)
                f = be.iterate(f)
            images[graph] = be.to_host(f)
            bound = be._fixed_bound
        if graph:
            assert bound == eager_bound
        eager_bound = bound
    assert np.array_equal(images[True], images[False])


@pytest.mark.gpu
def test_graphs_are_on_by_default_on_several_gpus_where_the_kernels_allow():
    """graph None (auto): one GPU launches kernel by kernel; several replay graphs (the same image as launched
    kernel by kernel); cuSPARSE's pair, which allocates, is never captured; an explicit setting wins."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    a, at, g, norm = _problem()
    with N.NcclBackend(a, g, norm, transpose=at, gpus=1, layout="local") as one:
        assert not one.graph
    with N.NcclBackend(a, g, norm, transpose=at, gpus=2, layout="local") as be:
        assert be.graph and be.describe()["graph"]
        graphed = _image(be)
        be.use_graph(False)
        assert np.array_equal(_image(be), graphed)
    with N.NcclBackend(a, g, norm, transpose=at, gpus=2, layout="local", fp="cusparse", bp="cusparse") as be:
        assert not be.graph
    with N.NcclBackend(a, g, norm, transpose=at, gpus=2, layout="local", graph=False) as be:
        assert not be.graph


def _banded(m=6000, n=4000, seed=3):
    """Rows sharing voxels with their neighbours (a reordered matrix's shape), a tenth empty."""
    import scipy.sparse as sp

    from mlemlib.matrix import CSRMatrix

    rng = np.random.default_rng(seed)
    rows, cols = [], []
    for i in range(m):
        if rng.random() < 0.1:
            continue
        k = int(rng.integers(1, 60))
        rows += [i] * k
        cols += list(int(i * (n - 80) / m) + rng.choice(80, size=k, replace=False))
    a = sp.csr_matrix((rng.uniform(0.1, 1.0, len(rows)), (rows, cols)), shape=(m, n)).astype(np.float32)
    a.sort_indices()
    x = rng.uniform(0.5, 1.5, n).astype(np.float32)
    g = rng.poisson(a @ x * 5).astype(np.float32)
    return CSRMatrix.from_scipy(a), g, np.asarray(a.sum(axis=0), dtype=np.float64).ravel()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["csr", "compressed", "compressed-f16"])
@pytest.mark.parametrize("bp", ["onepass_chunked", "onepass_fixed"])
def test_deterministic_one_passes_give_the_one_gpu_image_on_every_gpu_count(fmt, bp):
    """The local layout of the whole-iteration kernels: each GPU its row block (chunked on its own for
    onepass_chunked), one all-reduce of the 64-bit fixed point: the one-GPU backend's image bit for bit."""
    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.compressed import CompressedMatrix

    a, g, norm = _banded()
    src = a if fmt == "csr" else CompressedMatrix.from_csr(a, fmt)
    ref = _image(CudaBackend(src, g, norm, bp=bp), iters=8)
    assert np.isfinite(ref).all() and ref.sum() > 0
    for p in sorted({1, 2, min(_gpus(), 4)}):
        if p > _gpus():
            continue
        with N.NcclBackend(src, g, norm, gpus=p, layout="local", bp=bp) as be:
            assert be.bp_kernel == bp and be.deterministic
            img = _image(be, iters=8)
            if bp == "onepass_chunked":
                assert be.describe()["chunks"]["count"] >= p
        assert np.array_equal(img, ref), (p, fmt, bp)


@pytest.mark.gpu
def test_auto_takes_the_chunked_one_pass_on_several_gpus_by_the_one_gpu_rule(monkeypatch):
    """bp=auto on N GPUs samples the chunks as on one GPU (registry.choose_auto): a banded matrix whose GPUs
    each get enough chunks runs onepass_chunked, the image equal to one GPU's."""
    from mlemlib import registry
    from mlemlib.backends.cuda import CudaBackend

    monkeypatch.setattr(registry, "CHUNK_WAVES_MIN", 0)  # this small matrix makes a few chunks only
    a, g, norm = _banded()
    one = CudaBackend(a, g, norm, transpose=_transpose(a))
    assert one.bp_kernel == "onepass_chunked"
    ref = _image(one, iters=5)
    p = min(_gpus(), 2)
    with N.NcclBackend(a, g, norm, gpus=p, layout="local") as be:
        assert be.bp_kernel == "onepass_chunked" and be.describe()["chunks"]["reuse_sample"] >= registry.CHUNK_REUSE_MIN
        assert np.array_equal(_image(be, iters=5), ref)
    with N.NcclBackend(a, g, norm, transpose=_transpose(a), gpus=p, layout="thesis") as be:
        assert be.bp_kernel == "csr_vector"  # the thesis layout keeps its pair


@pytest.mark.gpu
def test_every_local_kernel_runs_on_several_gpus():
    """Every kernel the registry gives the local layout runs there: the image within float32 rounding of the
    one-GPU backend's (the same bits for the deterministic ones with the same lanes)."""
    from mlemlib import registry
    from mlemlib.backends.cuda import CudaBackend

    a, at, g, norm = _problem()
    p = min(_gpus(), 2)
    for k in registry.KERNELS:
        if k.backend != "cuda" or "local" not in k.layouts or "csr" not in k.formats or k.op not in ("back_notrans",):
            continue
        ref = _image(CudaBackend(a, g, norm, fp="csr_vector", bp=k.name), iters=5)
        with N.NcclBackend(a, g, norm, gpus=p, layout="local", fp="csr_vector", bp=k.name) as be:
            img = _image(be, iters=5)
        rel = np.linalg.norm(img.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64))
        assert rel < 1e-5, (k.name, rel)


def test_subset_plans_give_each_gpu_an_nnz_balanced_share_of_every_subset(rng):
    from mlemlib.backends._nccl_plan import build_plan, indptr_of
    from mlemlib.backends.osem import subset_plans

    a = _matrix(rng, m=400, n=50)
    ip = indptr_of(a)
    bounds = np.array([0, 90, 250, 400])
    plans = subset_plans(ip, bounds, 3, a.shape[1])
    assert len(plans) == 3
    for k, p in enumerate(plans):
        rows = p["rows"]
        assert rows[0][0] == bounds[k] and rows[-1][1] == bounds[k + 1]
        assert all(r1 == r0n for (_, r1), (r0n, _) in zip(rows, rows[1:]))  # contiguous, in order
        share = [int(ip[r1] - ip[r0]) for r0, r1 in rows]
        assert max(share) - min(share) <= int(np.diff(ip[bounds[k]:bounds[k + 1] + 1]).max())  # within one row
        assert build_plan(a, None, 3, p, "local")["rows"] == rows  # what NcclBackend checks and takes


@pytest.mark.gpu
def test_reconstruct_on_two_gpus_replays_graphs_and_times_the_steps_kernel_by_kernel(tmp_path):
    """mlem reconstruct on 2 GPUs with the default graph setting: the run replays graphs (config graph true, asked
    auto), its last repetition carries the steps of iterations launched kernel by kernel, and the image is the one
    of the same run without graphs, bit for bit."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    from mlemlib.image import read_image
    from mlemlib.mlem import reconstruct
    from mlemlib.problem import ModelSpec, RunSettings

    a, at, g, norm = _problem()
    got = {}
    for graph in (None, False):
        out = tmp_path / f"{graph}" / "image.h5"
        t = reconstruct(ModelSpec(a, g.astype(np.int32)),
                        RunSettings(6, repetitions=2, checkpoint_every=0, backend="cuda", gpus=2, graph=graph), out)
        got[graph] = (t, read_image(out)[0])
    t, img = got[None]
    assert t["config"]["graph"] is True and t["config"]["graph_requested"] == "auto"
    kbk = t["repetitions"][-1]["steps_kernel_by_kernel"]
    assert {"fp", "bp", "allreduce"} <= set(kbk) and kbk["allreduce"]["n"] == 5
    assert set(t["repetitions"][0]["steps"]) == {"iteration"}
    t0, img0 = got[False]
    assert t0["config"]["graph"] is False and t0["config"]["graph_requested"] is False
    assert "steps_kernel_by_kernel" not in t0["repetitions"][-1] and "allreduce" in t0["repetitions"][0]["steps"]
    assert np.array_equal(img, img0)
