"""CPU-side logic of the CUDA backend and the benchmark: no GPU needed (runs in CI).

Lane choice, launch shapes, byte counts, chunking, kernel-name resolution, the
synthetic tube-of-response matrix against its brute-force definition, the
report formats and the ``mlem bench`` command line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mlemlib.backends import _cuda_plan as plan
from mlemlib.bench import (
    _time_iteration,
    check_formats,
    auto_versus_fastest,
    format_csv,
    format_markdown,
    kernel_label,
    tor_geometry,
    tor_matrix,
    write_results,
)
from mlemlib.cli import main
from mlemlib.devices import theoretical_bandwidth
from mlemlib.errors import ConfigError


# --------------------------------------------------------------------------- lanes and launch shapes
@pytest.mark.parametrize(
    ("mean", "lanes"),
    [
        (0, 2),
        (-1, 2),
        (math.nan, 2),
        (1, 2),
        (8, 2),
        (8.5, 4),
        (16, 4),
        (17, 8),
        (32, 8),
        (33, 16),
        (64, 16),
        (65, 32),
        (128, 32),
        (594.2, 32),
        (1e6, 32),
    ],
)
def test_choose_lanes(mean, lanes):
    # one trip of L lanes covers 4 L non-zeros: L = next power of two >= mean / 4, in [2, 32]
    assert plan.choose_lanes(mean) == lanes


def test_launch_shape_counts_blocks_and_caps_at_waves():
    # 1000 rows, 8 rows per block -> 125 blocks
    assert plan.launch_shape(1000, 8, sm_count=132, max_threads_per_sm=2048) == (125, 256)
    assert plan.launch_shape(1001, 8, 132, 2048) == (126, 256)
    # no work still launches one block (the kernels loop zero times)
    assert plan.launch_shape(0, 8, 132, 2048) == (1, 256)
    # H100: 132 SMs x 8 blocks of 256 threads x 16 waves
    assert plan.launch_shape(10**9, 8, 132, 2048) == (132 * 8 * plan.WAVES, 256)
    assert plan.launch_shape(10**9, 1, 2, 1024, threads=128) == (2 * 8 * plan.WAVES, 128)
    with pytest.raises(ValueError):
        plan.launch_shape(10, 0, 132, 2048)


def test_launch_shape_waves_override():
    # 2 waves on an H100: 132 SMs x 8 resident blocks x 2
    assert plan.launch_shape(10**9, 8, 132, 2048, waves=2) == (132 * 8 * 2, 256)
    # 0 lifts the cap: one row group per block slot, 10^9 / 8 blocks
    assert plan.launch_shape(10**9, 8, 132, 2048, waves=0) == (125_000_000, 256)
    assert plan.launch_shape(0, 8, 132, 2048, waves=0) == (1, 256)
    with pytest.raises(ValueError, match="waves"):
        plan.launch_shape(10, 8, 132, 2048, waves=-1)


# --------------------------------------------------------------------------- byte counts
def test_spmv_bytes_hand_counted():
    # 3 x 4 matrix with 5 nnz: 5 * (4 + 4) + 8 * 4 row pointers + 4 * 4 (x) + 4 * 3 (y)
    assert plan.spmv_bytes(3, 4, 5) == 40 + 32 + 16 + 12
    assert plan.spmv_bytes(3, 4, 5, rowptr_itemsize=4) == 40 + 16 + 16 + 12
    assert plan.csr_bytes(3, 5) == 40 + 32


def test_iteration_floor_counts_both_matrices():
    m, n, nnz = 1_347_840, 784_000, 800_858_760
    a = 8 * nnz + 8 * (m + 1)
    t = 8 * nnz + 8 * (n + 1)
    assert plan.iteration_floor_bytes(m, n, nnz) == a + t
    assert plan.iteration_floor_bytes(m, n, nnz, transpose=False) == 2 * a
    # the row pointer is under 0.2% of a PET matrix
    assert 8 * (m + 1) / a < 2e-3


def test_merge_threads():
    assert plan.merge_threads(3, 5, 3) == 3  # 8 merge items, 3 per thread
    assert plan.merge_threads(3, 5, 1) == 8
    assert plan.merge_threads(0, 0, 5) == 0
    with pytest.raises(ConfigError, match="secsize"):
        plan.merge_threads(3, 5, 0)


def test_chunk_rows_balances_nnz_and_covers_every_row():
    lengths = np.array([5, 0, 3, 10, 2, 0, 0, 7])
    indptr = np.concatenate(([0], np.cumsum(lengths)))
    b = plan.chunk_rows(indptr, 6)
    assert b[0] == 0 and b[-1] == len(lengths)
    assert np.all(np.diff(b) >= 1)
    # each chunk ends at the first row boundary at or past a multiple of 6 nnz
    assert b.tolist() == [0, 3, 4, 8]
    # one chunk when the target exceeds nnz
    assert plan.chunk_rows(indptr, 1000).tolist() == [0, 8]
    assert plan.chunk_rows(np.zeros(1, dtype=np.int64), 10).tolist() == [0]
    # an all-empty matrix: one chunk of all rows
    assert plan.chunk_rows(np.zeros(5, dtype=np.int64), 10).tolist() == [0, 4]


def test_theoretical_bandwidth_h100():
    # H100 SXM HBM3: 2619 MHz, 5120-bit bus -> 3.35 TB/s
    assert theoretical_bandwidth(2619, 5120) == pytest.approx(3.352e12, rel=1e-3)


# --------------------------------------------------------------------------- synthetic matrix
def _brute_force_tor(nx, ny, nz, na, no, width=3.0):
    g = tor_geometry(nx, ny, nz, na, no, width)
    rows_c, rows_v = [], []
    for r in range(g["m"]):
        p, a, o = r // (na * no), (r % (na * no)) // no, r % no
        s = (o - (no - 1) * 0.5) * g["ds"]
        cols, vals = [], []
        for z in (p, p + 1) if nz > 1 else (0,):
            for y in range(ny):
                for x in range(nx):
                    d = abs((x - g["cx"]) * g["cs"][a] + ((y - g["cy"]) * g["sn"][a] - s))
                    if d < g["w"]:
                        cols.append((z * ny + y) * nx + x)
                        vals.append(1.0 - d / g["w"])
        rows_c.append(cols)
        rows_v.append(vals)
    return g, rows_c, rows_v


@pytest.mark.parametrize("dims", [(12, 9, 3, 6, 10), (7, 7, 1, 5, 4), (4, 15, 2, 8, 9)])
def test_tor_matrix_matches_its_definition(dims):
    a = tor_matrix(*dims)
    a.validate("tor")
    g, cols, vals = _brute_force_tor(*dims)
    assert a.shape == (g["m"], g["n"])
    for r in range(g["m"]):
        k0, k1 = a.indptr[r], a.indptr[r + 1]
        assert a.indices[k0:k1].tolist() == cols[r], r
        np.testing.assert_array_equal(a.data[k0:k1], np.asarray(vals[r], dtype=np.float32))
    assert a.data.min() > 0 and a.data.max() <= 1


def test_tor_matrix_has_empty_rows_and_sinogram_order():
    a = tor_matrix(16, 12, 3, 10, 14)
    lengths = np.diff(a.indptr).reshape(2, 10, 14)  # (plane, angle, offset)
    # the outermost offsets run along the image diagonal's ends and miss the grid at most angles
    assert (lengths == 0).sum() == 20
    assert (lengths[:, :, 0] == 0).any() and not (lengths[:, :, 7] == 0).any()
    # both planes see the same 2-D geometry: equal lengths plane by plane
    np.testing.assert_array_equal(lengths[0], lengths[1])


def test_tor_geometry_rejects_bad_sizes():
    with pytest.raises(ConfigError, match="n_angles"):
        tor_geometry(4, 4, 1, 0, 3)
    with pytest.raises(ConfigError, match="width"):
        tor_geometry(4, 4, 1, 2, 3, width=0)


# --------------------------------------------------------------------------- reports
def _result():
    return {
        "date": "2026-11-22",
        "device": {"name": "NVIDIA H100 80GB HBM3", "theoretical_bandwidth": 3.352e12},
        "copy": {"bandwidth": 3.0e12, "bytes": 1 << 32, "median_s": 1.43e-3},
        "repeat": 30,
        "warmup": 5,
        "matrix": {
            "label": "m.h5",
            "shape": [10, 20],
            "nnz": 50,
            "bytes": 488,
            "mean_row_length": 5.0,
            "max_row_length": 9,
            "empty_rows": 1,
            "empty_cols": 2,
        },
        "kernels": [
            {
                "op": "fp",
                "kernel": "cusparse",
                "deterministic": True,
                "median_s": 2.0e-3,
                "bandwidth": 2.7e12,
                "of_copy": 0.9,
                "vs_cusparse": 1.0,
                "rel_l2": 3e-8,
                "bytes": 5_400_000_000,
            },
            {
                "op": "fp",
                "kernel": "csr_vector",
                "lanes": 32,
                "lanes_auto": True,
                "deterministic": True,
                "median_s": 2.5e-3,
                "rounds_s": [2.49e-3, 2.512e-3],
                "bandwidth": 2.16e12,
                "of_copy": 0.72,
                "vs_cusparse": 0.8,
                "rel_l2": 4e-8,
                "bytes": 5_400_000_000,
            },
            {
                "op": "bp_notrans",
                "kernel": "merge",
                "secsize": 5,
                "deterministic": False,
                "median_s": 9e-3,
                "bandwidth": 6e11,
                "of_copy": 0.2,
                "vs_cusparse": None,
                "rel_l2": None,
                "bytes": 5_400_000_000,
            },
        ],
        "iterations": [
            {
                "fp": "csr_vector",
                "bp": "csr_vector",
                "deterministic": True,
                "fused": ["corr into fp"],
                "median_s": 6e-3,
                "floor_s": 5.4e-3,
                "of_floor": 0.9,
            },
        ],
    }


def test_interleave_positions_hand_counted():
    # row 0 = [1, 50): head 1..3, quads 1..8 (two trips of 4), quads 9..11 (a trip of 3), tail 48, 49;
    # row 1 = [50, 52): no whole quad; row 2 = [52, 52) empty; row 3 = [52, 61): quads 13, 14 (a trip of 2)
    indptr = np.array([1, 50, 52, 52, 61])
    pos = plan.interleave_positions(indptr, 4)
    assert sorted(pos.tolist()) == list(range(1, 61))  # a permutation of the elements
    stored = np.full(64, -1)
    stored[pos] = np.arange(1, 61)
    quads = stored.reshape(-1, 4)
    assert quads[0].tolist() == [-1, 1, 2, 3]  # the head keeps its slots
    # lane l of a trip of Q quads holds the trip's elements l, Q + l, 2 Q + l, 3 Q + l
    assert quads[1:5].tolist() == [[4, 8, 12, 16], [5, 9, 13, 17], [6, 10, 14, 18], [7, 11, 15, 19]]
    assert quads[5].tolist() == [20, 24, 28, 32]
    assert quads[9:12].tolist() == [[36, 39, 42, 45], [37, 40, 43, 46], [38, 41, 44, 47]]
    assert quads[12].tolist() == [48, 49, 50, 51]  # row 0's tail, row 1 (no quad of its own)
    assert quads[13:15].tolist() == [[52, 54, 56, 58], [53, 55, 57, 59]]
    assert stored[60] == 60  # row 3's tail
    # 32 lanes on the same rows: every trip is partial
    pos32 = plan.interleave_positions(indptr, 32)
    stored32 = np.full(64, -1)
    stored32[pos32] = np.arange(1, 61)
    assert stored32[4:8].tolist() == [4, 15, 26, 37]  # a trip of Q = 11 quads
    with pytest.raises(ConfigError, match="lanes"):
        plan.interleave_positions(indptr, 3)
    assert plan.interleave_positions(np.array([0]), 32).size == 0


@pytest.mark.parametrize(
    ("fp", "bp", "transpose", "enabled", "want"),
    [
        ("csr_vector", "csr_vector", True, True, (32, 16)),
        ("csr_vector", "cusparse", True, True, (32, 0)),
        ("cusparse", "csr_vector", True, True, (0, 16)),
        ("csr_vector", "scatter", False, True, (0, 0)),  # the scatter reads A: columns in order
        ("csr_vector", "onepass", False, True, (0, 0)),
        ("csr_vector", "csr_vector", True, False, (0, 0)),
    ],
)
def test_row_layouts_interleave_only_what_csr_vector_alone_reads(fp, bp, transpose, enabled, want):
    assert plan.row_layouts(fp, bp, transpose, 32, 16, enabled) == want
    assert plan.row_layouts(fp, bp, transpose, 4, 2, enabled) == (0, 0)  # short rows: column order


@pytest.mark.parametrize("m", [3, 4, 10, 81, 1152, 1327104, 2 * 3 * 5 * 7 * 11 * 13])
def test_spread_stride_visits_every_row_once_far_from_its_neighbours(m):
    p = plan.spread_stride(m)
    assert math.gcd(p, m) == 1 and int(m / plan.GOLDEN) <= p < m
    if m <= 1_000_000:
        order = (np.arange(m, dtype=np.int64) * p) % m
        assert np.array_equal(np.sort(order), np.arange(m))  # a permutation: every row once
        if m >= 1000:  # consecutive lane groups take rows far apart
            assert np.abs(np.diff(order[:64])).min() > m // 10


@pytest.mark.parametrize("m", [0, 1, 2, 1 << 32, (1 << 32) + 7])
def test_spread_stride_keeps_the_order_where_it_cannot_spread(m):
    assert plan.spread_stride(m) == 1


def test_kernel_label():
    assert kernel_label({"kernel": "merge", "secsize": 7}) == "merge (secsize 7)"
    assert kernel_label({"kernel": "csr_vector", "lanes": 32, "shape": "512t w0 stream", "layout": 32}) == (
        "csr_vector (32 lanes, 512t w0 stream, interleaved)")
    assert kernel_label({"kernel": "csr_vector", "lanes": 8, "lanes_auto": False}) == "csr_vector (8 lanes, forced)"
    assert kernel_label({"kernel": "csr_vector", "lanes": 32, "lanes_auto": True}) == "csr_vector (32 lanes)"
    assert kernel_label({"kernel": "scatter", "lanes": 32}) == "scatter"


def test_format_markdown_tables():
    md = format_markdown(_result())
    assert "## SpMV benchmark: m.h5" in md
    assert "3.000 TB/s" in md and "theoretical 3.35 TB/s" in md
    assert "| csr_vector (32 lanes) | yes | 2.500 | 2.490 / 2.512 | 2.160 | 72.0% | 0.80 | 4.0e-08 |" in md
    assert "| merge (secsize 5) | no | 9.000 | - | 0.600 | 20.0% | - | - |" in md  # no rounds recorded
    assert "in two rounds (the second in the reverse order" in md
    assert "### back A^T c (no transpose)" in md
    assert "### back A^T c (stored transpose)" not in md  # no rows for it
    assert "| csr | - | csr_vector | csr_vector | yes | corr into fp | 6.000 | 5.400 | 90.0% | - | - |" in md
    assert "auto ran" not in md  # no auto + auto row in this result


def test_markdown_says_how_long_the_clocks_were_capped():
    res = _result()
    res["clocks"] = {"run_s": 42.04, "capped_s": {"power": 1.5, "thermal": 0.25}, "note": "NVML clock-capping counters"}
    res["iterations"][0]["clock_capped_s"] = {"power": 0.125, "thermal": 0.0}
    md = format_markdown(res)
    assert ("- clock capping during the run (NVML): held down by the power limit 1.50 s, by heat 0.25 s, of "
            "42.0 s; a capped GPU lowers its SM clock") in md
    assert "| 90.0% | - | - | 0.12 |" in md  # the iteration's own 0.125 s
    res["clocks"] = {"run_s": 42.0, "capped_s": {"power": 0.0, "thermal": 0.0}, "note": "NVML clock-capping counters"}
    md = format_markdown(res)
    assert "held down by the power limit 0.00 s, by heat 0.00 s, of 42.0 s\n" in md  # no explanation when uncapped
    res["clocks"] = {"run_s": 42.0, "capped_s": None, "note": "not available: pynvml (nvidia-ml-py) not installed"}
    assert ("- clock capping during the run: not measured (not available: pynvml (nvidia-ml-py) not installed)"
            in format_markdown(res))
    del res["clocks"], res["iterations"][0]["clock_capped_s"]
    md = format_markdown(res)
    assert "clock capping" not in md and "| 90.0% | - | - | - |" in md  # an older result: nothing claimed


def test_markdown_puts_auto_beside_the_fastest_and_shows_a_refused_pair():
    res = _result()
    its = res["iterations"]
    its[0].update(fp_requested="auto", bp_requested="auto")
    its += [
        {"fp_requested": "auto", "fp": "onepass_chunked", "bp": "onepass_chunked", "bp_requested": "onepass_chunked",
         "deterministic": True, "fused": [], "median_s": 4.5e-3, "floor_s": 5.4e-3, "of_floor": 1.2},
        {"fp_requested": "cusparse", "fp": "cusparse", "bp": "cusparse", "bp_requested": "cusparse",
         "deterministic": False, "fused": [], "median_s": 4.0e-3, "floor_s": 5.4e-3, "of_floor": 1.35},
        {"fp_requested": "auto", "bp_requested": "onepass_chunked", "error": "bp=onepass_chunked: a row has 9 non-zeros"},
    ]
    md = format_markdown(res)
    assert ("auto ran csr_vector + csr_vector: 6.000 ms; the fastest iteration of this run is cusparse + cusparse: "
            "4.000 ms (auto takes 1.50x its time); the fastest deterministic one is onepass_chunked + "
            "onepass_chunked: 4.500 ms.") in md
    assert "| csr | | auto | onepass_chunked | not run: bp=onepass_chunked: a row has 9 non-zeros |" in md
    assert auto_versus_fastest([its[-1]]) == ""
    # another format's rows are compared among themselves: a faster lossy iteration is not CSR's fastest
    its += [
        {"format": "compressed-f16", "fp_requested": "auto", "bp_requested": "auto", "fp": "onepass_chunked",
         "bp": "onepass_chunked", "deterministic": True, "fused": [], "median_s": 2.0e-3},
        {"format": "compressed-f16", "fp_requested": "delta_vector", "bp_requested": "delta_vector",
         "fp": "delta_vector", "bp": "delta_vector", "deterministic": True, "fused": [], "median_s": 3.0e-3},
    ]
    text = auto_versus_fastest(its)
    assert text.split("\n\n") == [
        "auto ran csr_vector + csr_vector: 6.000 ms; the fastest iteration of this run is cusparse + cusparse: "
        "4.000 ms (auto takes 1.50x its time); the fastest deterministic one is onepass_chunked + "
        "onepass_chunked: 4.500 ms.",
        "compressed-f16: auto ran onepass_chunked + onepass_chunked: 2.000 ms; the fastest iteration of this run "
        "in compressed-f16 is onepass_chunked + onepass_chunked: 2.000 ms (auto takes 1.00x its time).",
    ]


def test_markdown_iteration_rows_give_format_floors_and_distance():
    res = _result()
    res["iterations"].append(
        {"format": "compressed-f16", "bytes_per_nnz": 4.06, "fp_requested": "auto", "fp": "onepass_chunked",
         "bp": "onepass_chunked", "bp_requested": "auto", "deterministic": True, "fused": [], "median_s": 2.5e-3,
         "floor_s": 1.3e-3, "of_floor": 0.52, "of_csr_floor": 2.16, "rel_l2_to_csr": 1.2e-3})
    md = format_markdown(res)
    assert ("| compressed-f16 | 4.06 | onepass_chunked | onepass_chunked (auto) | yes | - | 2.500 | 1.300 | 52.0% | "
            "216.0% | 1.2e-03 |") in md
    assert "after 35 iterations from the same start" in md  # warmup 5 + repeat 30
    assert "decoded for the kernels" not in md
    res["matrix"]["format"] = "compressed"
    assert "(0.00 GB as CSR; the file is compressed, decoded for the kernels), row length" in format_markdown(res)


def test_check_formats():
    assert check_formats(["csr", "compressed-f16", "csr"]) == ("csr", "compressed-f16")
    with pytest.raises(ConfigError, match="csr4"):
        check_formats(["csr", "csr4"])
    with pytest.raises(ConfigError, match="none"):
        check_formats([])


class _FakeBackend:
    """The parts of CudaBackend _time_iteration reads, on NumPy: 2 ms per iteration, f doubled each time."""

    def __init__(self, a, g, norm, at, *, fp, bp, device):
        if bp == "refused":
            raise ConfigError("bp", "refused here")
        self.a, self.at = a, at
        self.onepass = bp.startswith("onepass")
        self.fp_kernel, self.bp_kernel, self.deterministic = fp, bp, True
        self.steps = 0

    def initial_image(self):
        return np.ones(3, dtype=np.float32)

    def iterate(self, f):
        self.steps += 1
        return 2 * f

    def last_step_times(self):
        return {"iteration": 2e-3}

    def describe(self):
        return {"fused": []}

    def to_host(self, f):
        return f


class _Mat:
    def __init__(self, nbytes, nnz):
        self.nbytes, self.nnz = nbytes, nnz


@pytest.mark.parametrize("bp, with_at, floor_bytes", [
    ("onepass_chunked", False, 600),  # one pass: A once
    ("csr_vector", True, 600 + 1000),  # pair: A and A^T
    ("scatter", False, 1200),  # back projection without A^T: A twice
])
def test_time_iteration_floors_and_image(bp, with_at, floor_bytes):
    a, at = _Mat(600, 100), _Mat(1000, 100)
    row, img = _time_iteration(_FakeBackend, "compressed", "auto", bp, a, at if with_at else None, None, None, 0,
                               2, 3, 1e6, 5e-3)
    assert row["floor_bytes"] == floor_bytes
    assert row["floor_s"] == pytest.approx(floor_bytes / 1e6)
    assert row["of_floor"] == pytest.approx(floor_bytes / 1e6 / 2e-3)
    assert row["of_csr_floor"] == pytest.approx(2.5)
    assert row["bytes_per_nnz"] == pytest.approx(6.0) and row["format"] == "compressed"
    assert row["median_s"] == pytest.approx(2e-3) and row["finite"]
    np.testing.assert_array_equal(img, np.full(3, 32.0))  # warmup 2 + repeat 3 iterations from ones


class _PipelinedFake(_FakeBackend):
    """A backend that pipelines: iteration k (from 1) took k ms, readable one iteration late."""

    pipelines = True

    def last_step_times(self):
        return {"iteration": self.steps * 1e-3}

    def previous_step_times(self):
        return {"iteration": (self.steps - 1) * 1e-3} if self.steps > 1 else None


def test_time_iteration_reads_a_pipelining_backend_one_iteration_late():
    # warmup 2, repeat 3: iterations 3, 4 and 5 are timed (3, 4, 5 ms), none twice, none of the warmup
    row, img = _time_iteration(_PipelinedFake, "csr", "auto", "csr_vector", _Mat(600, 100), _Mat(1000, 100), None,
                               None, 0, 2, 3, 1e6, 5e-3)
    assert row["median_s"] == pytest.approx(4e-3) and row["min_s"] == pytest.approx(3e-3)
    np.testing.assert_array_equal(img, np.full(3, 32.0))


def test_time_iteration_reports_a_refused_configuration():
    row, img = _time_iteration(_FakeBackend, "csr", "auto", "refused", _Mat(8, 1), None, None, None, 0, 1, 1, 1.0, 1.0)
    assert img is None and row["error"].endswith("refused here") and row["format"] == "csr"


def test_format_csv_rows():
    text = format_csv(_result())
    lines = text.strip().splitlines()
    assert lines[0].split(",") == list(format_csv.__globals__["CSV_FIELDS"])
    assert len(lines) == 4
    assert lines[2].startswith("fp,csr_vector,32,,True,0.0025,")


def test_write_results_round_trip(tmp_path):
    res = _result()
    res["copy"]["bytes"] = np.int64(res["copy"]["bytes"])  # NumPy scalars serialise
    out = tmp_path / "sub" / "bench.json"
    write_results(res, out_json=out, out_md=tmp_path / "bench.md", out_csv=tmp_path / "bench.csv")
    back = json.loads(out.read_text())
    assert back["kernels"][1]["lanes"] == 32 and back["copy"]["bytes"] == 1 << 32
    assert (tmp_path / "bench.md").read_text().startswith("## SpMV benchmark")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["bench.csv", "bench.json", "bench.md", "sub"]


# --------------------------------------------------------------------------- command line
def test_cli_bench_spmv_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "spmv", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--transpose" in out and "--repeat" in out and "--markdown" in out and "--synthetic" in out


def test_cli_bench_spmv_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "spmv", str(tmp_path / "nope.h5"), "--out", str(tmp_path / "b.json")])
    assert exc.value.code == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_bench_spmv_needs_one_input(tmp_path, capsys):
    code = main(["bench", "spmv", "--out", str(tmp_path / "b.json")])
    assert code == 2
    assert "either MATRIX or --synthetic" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_cli_bench_spmv_rejects_bad_lists(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "spmv", "--synthetic", "1,2,3", "--out", str(tmp_path / "b.json")])
    assert exc.value.code == 2
    assert "NX,NY,NZ,ANGLES,OFFSETS" in capsys.readouterr().err
    code = main(["bench", "spmv", "--synthetic", "4,4,2,3,3", "--lanes", "3", "--out", str(tmp_path / "b.json")])
    assert code == 2
    assert "--lanes" in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_spmv_on_gpu_checks_and_reports_every_kernel(tmp_path):
    # A small PET-like matrix: every kernel's output is compared with a float64
    # product (check=True); every row carries a time, a bandwidth and an error
    # within the float32 rounding bound.
    from mlemlib.bench import bench_spmv, tor_matrix

    a = tor_matrix(24, 24, 3, 16, 33)
    out_json, out_md, out_csv = tmp_path / "b.json", tmp_path / "b.md", tmp_path / "b.csv"
    res = bench_spmv(a, repeat=3, warmup=1, copy_bytes=1 << 24, out_json=out_json, out_md=out_md, out_csv=out_csv)
    assert res["copy"]["bandwidth"] > 0
    rows = res["kernels"]
    assert {r["kernel"] for r in rows} >= {"csr_vector", "cusparse", "merge"}
    assert {r["op"] for r in rows} >= {"fp"}
    for r in rows:
        assert r["median_s"] > 0 and r["bandwidth"] > 0 and r["nan"] == 0, r
        assert r["worst_of_bound"] <= 1.0, r
    assert res["iterations"]
    for it in res["iterations"]:
        assert it["median_s"] > 0 and it["finite"], it
    ref = [it for it in res["iterations"] if (it["format"], it["fp_requested"], it["bp_requested"])
           == ("csr", "csr_vector", "csr_vector")]
    assert ref and ref[0]["rel_l2_to_csr"] == 0.0
    # csr_vector also in the interleaved layout (a copy), where auto's choice is, as a backend sets it
    for op, lanes in (("fp", res["matrix"]["lanes_fp"]), ("bp", res["matrix"]["lanes_bp"])):
        auto = [r for r in rows if r["op"] == op and r.get("auto")]
        assert len(auto) == 1 and auto[0].get("layout", 0) == (lanes if lanes in plan.BLOCK_LANES else 0), auto
        assert any(r["op"] == op and r["kernel"] == "csr_vector" and not r.get("layout") for r in rows)
    saved = json.loads(out_json.read_text())["kernels"]
    assert [(r["op"], r["kernel"]) for r in saved] == [(r["op"], r["kernel"]) for r in rows]
    assert out_md.read_text().count("|") > 10 and len(out_csv.read_text().splitlines()) == len(rows) + 1


def test_choose_lanes_cap():
    # rows of ~1,000 non-zeros want a warp; a cap of 16 holds them to half of one
    assert plan.choose_lanes(1000.0) == 32
    assert plan.choose_lanes(1000.0, cap=16) == 16
    # the cap does not raise short rows
    assert plan.choose_lanes(20.0, cap=16) == 8
    with pytest.raises(ValueError, match="cap"):
        plan.choose_lanes(100.0, cap=12)


def test_row_shapes_name_their_builds():
    default = plan.RowShape()
    assert default.is_default and default.options() == () and default.label() == "256t"
    s = plan.RowShape(1024, True, 0, True, 2)
    assert not s.is_default
    assert s.options() == ("-DMLEM_STREAM", "-DMLEM_BLOCK_MINB=2")
    assert s.label() == "1024t sync w0 stream mb2"
    u = plan.RowShape(512, False, 0, True, unroll=2)
    assert u.options() == ("-DMLEM_STREAM", "-DMLEM_VEC_UNROLL=2") and u.label() == "512t w0 stream u2"
    assert not plan.RowShape(unroll=2).is_default and plan.RowShape(unroll=plan.VEC_UNROLL).is_default
    # csr_row_L: its own kernel and launch bound; waves and sync do not apply to it, so the label leaves them out
    r = plan.RowShape(1024, False, 0, True, 2, unroll=1, row_bound=1024)
    assert (r.kernel, s.kernel, default.kernel) == ("csr_row", "csr_block", "csr_vector")
    assert r.options() == ("-DMLEM_STREAM", "-DMLEM_BLOCK_MINB=2", "-DMLEM_VEC_UNROLL=1", "-DMLEM_ROW_BOUND=1024")
    assert r.label() == "1024t row1024 stream mb2 u1"
    assert plan.RowShape(768, False, 0, True, 2, unroll=2, row_bound=768).label() == "768t row768 stream mb2 u2"
    with pytest.raises(ValueError, match="row_bound"):
        plan.RowShape(1024, row_bound=512)  # a block larger than the bound the kernel is compiled for
    with pytest.raises(ValueError, match="row_bound"):
        plan.RowShape(256, row_bound=2048)
    assert any(c.row_bound for c in plan.SHAPE_CANDIDATES)
    # the build default is spmv.cu's own
    src = (Path(plan.__file__).parents[1] / "kernels" / "spmv.cu").read_text()
    assert f"#define MLEM_VEC_UNROLL {plan.VEC_UNROLL}\n" in src
    # csr_row_L exists for every lane count a non-default shape may take
    assert all(f"CSR_ROW({L})" in src and f"CSR_BLOCK({L})" in src for L in plan.BLOCK_LANES)
    # every candidate the backends tune over is a legal launch: at most 1024 threads, whole warps
    assert plan.SHAPE_CANDIDATES[0].is_default
    for c in plan.SHAPE_CANDIDATES:
        assert c.threads <= 1024 and c.threads % 32 == 0
        assert plan.launch_shape(10**6, c.threads // 32, 132, 2048, threads=c.threads, waves=c.waves)[1] == c.threads
    # no grid-stride loop (waves 0): one block per row group, however many
    assert plan.launch_shape(10**6, 32, 132, 2048, threads=1024, waves=0)[0] == 10**6 // 32


def test_auto_is_shown_beside_the_fastest():
    from mlemlib.bench import auto_vs_fastest

    def row(op, kernel, ms, det=True, **kw):
        return {"op": op, "kernel": kernel, "median_s": ms / 1e3, "deterministic": det, **kw}

    result = {"kernels": [
        row("fp", "cusparse", 2.6, det=False, auto=False),
        row("fp", "csr_vector", 2.8, lanes=32, lanes_auto=True, shape="256t", auto=True),
        row("fp", "csr_vector", 2.7, lanes=32, lanes_auto=True, shape="512t w0 stream", auto=False),
        row("bp", "csr_vector", 2.7, lanes=32, lanes_auto=True, shape="512t w0 stream", auto=True),
        row("bp", "cusparse", 3.6, det=False, auto=False),
    ]}
    fp, bp = auto_vs_fastest(result)
    assert fp["auto"] == "csr_vector (32 lanes)" and fp["fastest"] == "cusparse"
    assert fp["slower_by"] == pytest.approx(2.8 / 2.6 - 1)
    assert fp["fastest_deterministic"] == "csr_vector (32 lanes, 512t w0 stream)"
    assert bp["slower_by"] == 0.0 and bp["fastest"] == bp["auto"] == "csr_vector (32 lanes, 512t w0 stream)"


@pytest.mark.gpu
def test_bench_spmv_runs_the_iterations_in_each_format(tmp_path):
    # The compressed formats' iterations: every row names its format and bytes per non-zero, the lossless
    # formats' images match the CSR pair's to float32 rounding, the float16 values' within their precision.
    from mlemlib.bench import FORMAT_ITERATION_BENCH, bench_spmv, tor_matrix

    a = tor_matrix(24, 24, 3, 16, 33)
    res = bench_spmv(a, repeat=3, warmup=1, copy_bytes=1 << 24, fp_kernels=("csr_vector",), bp_kernels=(),
                     notrans_kernels=(), iterations=(("csr_vector", "csr_vector"),),
                     formats=("csr", "compressed", "compressed-f16"))
    its = res["iterations"]
    assert [it["format"] for it in its] == ["csr"] + ["compressed"] * 4 + ["compressed-f16"] * 4
    assert [(it["fp_requested"], it["bp_requested"]) for it in its[1:5]] == list(FORMAT_ITERATION_BENCH)
    for it in its:
        assert "error" not in it, it
        assert it["median_s"] > 0 and it["finite"] and it["of_csr_floor"] > 0, it
    for it in its[1:5]:
        assert it["bytes_per_nnz"] < 8 and it["rel_l2_to_csr"] < 1e-5, it
    for it in its[5:]:
        assert it["rel_l2_to_csr"] < 1e-2, it
    assert "| compressed-f16 |" in format_markdown(res)


@pytest.mark.gpu
def test_bench_spmv_on_a_compressed_file_decodes_it_and_adds_its_format(tmp_path):
    # The kernels read CSR: a compressed container is decoded as it goes to the GPU, checked against float64
    # like any matrix, and its own format's iterations are timed without being asked for.
    from mlemlib.bench import bench_spmv, tor_matrix
    from mlemlib.formats.compressed_h5 import write_compressed_h5

    path = tmp_path / "m.h5"
    write_compressed_h5(path, tor_matrix(24, 24, 3, 16, 33), fmt="compressed")
    res = bench_spmv(path, repeat=2, warmup=1, copy_bytes=1 << 24, fp_kernels=("csr_vector",), bp_kernels=(),
                     notrans_kernels=(), iterations=(("csr_vector", "csr_vector"),))
    assert res["matrix"]["format"] == "compressed"
    assert res["kernels"][0]["worst_of_bound"] <= 1.0
    assert [it["format"] for it in res["iterations"]] == ["csr"] + ["compressed"] * 4
