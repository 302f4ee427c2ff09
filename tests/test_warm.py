"""mlemlib.backends.warm without a GPU: which kernel choices of a workflow's runs it warms, and that a choice
that fails is recorded, not raised (its run reports it); the float64 reference runs for real on the host."""

from __future__ import annotations

import numpy as np
import pytest

from mlemlib.backends import _build
from mlemlib.backends import warm


def test_small_problem_is_a_consistent_problem():
    a, g, norm = warm.small_problem()
    s = a.to_scipy().astype(np.float64)
    assert a.nnz > 1000 and g.dtype == np.float32 and norm.dtype == np.float64
    np.testing.assert_allclose(g, s @ np.ones(a.shape[1]), rtol=1e-6)
    np.testing.assert_allclose(norm, np.asarray(s.sum(axis=0)).ravel())


def test_run_choices_count_each_kernel_choice_once_and_multi_gpu_runs_as_their_layout():
    runs = [
        {"backend": "cuda", "fp": "auto", "bp": "auto", "secsize": None, "graph": False, "gpus": g, "layout": "local"}
        for g in (1, 2, 4)
    ] + [
        {"backend": "cuda", "fp": "csr_vector", "bp": "csr_vector", "secsize": None, "graph": False, "gpus": 2,
         "layout": "thesis"},
        {"backend": "cuda", "fp": "auto", "bp": "auto", "secsize": None, "graph": True, "gpus": 1, "layout": "local"},
        {"backend": "cpu", "fp": "auto", "bp": "auto", "secsize": None, "graph": False, "gpus": 1, "layout": "local"},
    ] + [  # the default graph setting: left to the backend (off on the warm-up's one GPU)
        {"backend": "cuda", "fp": "auto", "bp": "auto", "secsize": None, "graph": "auto", "gpus": g, "layout": "local"}
        for g in (1, 2)
    ]
    got = [(c["fp"], c["bp"], c["nccl"], c["layout"], c["graph"]) for c in warm.run_choices(runs)]
    assert got == [("auto", "auto", False, "local", False), ("auto", "auto", True, "local", False),
                   ("csr_vector", "csr_vector", True, "thesis", False), ("auto", "auto", True, "local", True),
                   ("auto", "auto", False, "local", None), ("auto", "auto", True, "local", None)]


def test_warm_up_records_a_failed_choice_and_goes_on(monkeypatch):
    compiled = []
    monkeypatch.setattr(_build, "prefetch", lambda builds, device: compiled.extend(builds))
    monkeypatch.setattr(_build, "module", lambda build, device: None)
    ran = []

    def run_choice(matrix, g, norm, choice, subsets, background):
        ran.append((choice["bp"], subsets, background, type(matrix).__name__))
        if choice["bp"] == "onepass_fixed":
            raise RuntimeError("no GPU here")

    monkeypatch.setattr(warm, "_run_choice", run_choice)
    measured = []
    monkeypatch.setattr(warm, "_copy_bandwidth", lambda: measured.append(True))
    runs = [{"backend": "cuda", "fp": "auto", "bp": bp, "secsize": None, "graph": False, "gpus": 1,
             "layout": "local"} for bp in ("auto", "onepass_fixed")]
    record = warm.warm_up(runs, formats=("csr", "compressed"), subsets=4, background=True)
    assert measured == [True] and record["choices"][-1]["copy_bandwidth"] is True  # every GPU run measures it
    assert len(compiled) == len(record["builds"]) > 3
    assert record["host"] == 0  # the host functions' process (warm_host) ended well
    assert ran == [(bp, s, True, kind) for kind in ("CSRMatrix", "CompressedMatrix")
                   for bp in ("auto", "onepass_fixed") for s in (1, 2)]  # MLEM, then OSEM of two subsets
    failed = [c for c in record["choices"] if "error" in c]
    assert [(c["bp"], c["format"], c["subsets"]) for c in failed] == [
        ("onepass_fixed", f, s) for f in ("csr", "compressed") for s in (1, 2)]
    assert all(c["error"] == "RuntimeError: no GPU here" for c in failed)
    assert len(record["choices"]) == 8 + 1


def test_the_host_warm_up_runs_the_functions_the_cpu_jobs_compile():
    """warm_host (the process warm_up starts) runs on the host alone: the decoder, the norm's and the
    measurement's passes, the float64 reference's iteration, the chunked layout, the benchmark's problem and
    float64 products of the small matrix; the norm's and the decoder's functions are compiled after it."""
    from mlemlib import _compressed_kernels, norm
    from mlemlib.backends import cpu

    warm.warm_host(reference=True, bench=True)
    assert norm._add_columns.signatures and _compressed_kernels._decode.signatures and cpu._spmv64.signatures


@pytest.mark.gpu
def test_warm_up_runs_every_choice_on_the_gpu():
    """On a GPU: every build compiles, and each choice (one GPU and the multi-GPU backend on one, CSR and
    compressed, OSEM with a background), cuSPARSE and the copy bandwidth run on the small matrix without an
    error, and the host's process ends well."""
    runs = [{"backend": "cuda", "fp": fp, "bp": bp, "secsize": None, "graph": graph, "gpus": gpus, "layout": "local"}
            for fp, bp, graph, gpus in (("auto", "auto", False, 1), ("auto", "auto", False, 2),
                                        ("auto", "auto", True, 2), ("auto", "onepass_fixed", False, 1))]
    record = warm.warm_up(runs, formats=("csr", "compressed"), bench=True)
    assert [c for c in record["choices"] if "error" in c] == [] and record["host"] == 0
    assert len(record["choices"]) == 2 * 4 + 2
    osem = warm.warm_up(runs[:1], subsets=8, background=True, reference=False, host=False)
    assert [c.get("subsets", "copy bandwidth") for c in osem["choices"]] == [1, 2, "copy bandwidth"]
    assert [c for c in osem["choices"] if "error" in c] == []


def test_graph_option_maps_a_configured_setting_to_the_backends_argument():
    """auto (or unset) leaves the choice to the backend (None); true and false are passed on, false too (a bench
    case or run that says false must not get the several-GPU default)."""
    from mlemlib.backends import graph_option

    assert graph_option("auto") is None and graph_option(None) is None
    assert graph_option(True) is True and graph_option(False) is False


def test_write_record_writes_the_json_whole(tmp_path):
    """The warm_kernels script's record: JSON read back equal; an existing record is replaced, no temporary left."""
    import json

    path = tmp_path / "kernels" / "default.json"
    path.parent.mkdir()
    path.write_text("old")
    record = {"seconds": 1.5, "builds": ["spmv.cu"], "choices": [{"fp": "auto", "error": "RuntimeError: x"}]}
    warm.write_record(record, path)
    assert json.loads(path.read_text()) == record
    assert [p.name for p in path.parent.iterdir()] == ["default.json"]
