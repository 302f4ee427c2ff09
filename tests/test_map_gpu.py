"""MAP with the step on the GPUs' streams (mlemlib._map_cuda): inside the pass's CUDA graph, against the float64
reference of the same algorithm, the same bits replayed or launched kernel by kernel and on 1 or 2 GPUs.

The problem is test_map's (60 voxels on a 5x4x3 grid, 240 LORs in 8 subsets, ``m`` with gaps, ``b > 0``, the RDP).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlemlib.image import read_image
from mlemlib.map import MapSettings
from mlemlib.mlem import reconstruct
from mlemlib.problem import ModelSpec, RunSettings
from test_map import S, case, rel  # noqa: F401 (case: the module fixture)

pytestmark = pytest.mark.gpu


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _run(case, out, passes, ms, *, subsets=S, **settings):
    """Reconstruct the case (its subset file where ``subsets`` is S, else MLEM) with MAP settings ``ms``."""
    d = case["dir"]
    model = ModelSpec(d / "a.h5", case["g"], subsets=subsets, subset_file=d / "subsets.i32" if subsets > 1 else None,
                      multiplicative=d / "m.f32", additive=d / "b.f32", map=ms)
    t = reconstruct(model, RunSettings(passes, checkpoint_every=0, **settings), out, raw_out=False)
    return read_image(out)[0], t


@pytest.mark.parametrize("algorithm,preconditioner,averaging,halving", [
    ("bsrem", "em", "last", ()), ("osl", "em", "last", ()), ("bsrem", "hessian", "last", ()),
    ("bsrem", "em", "pass", ()), ("bsrem", "em", "last", (10, 20, 30)), ("bsrem", "hessian", "pass", (3, 6))])
def test_the_step_runs_inside_the_pass_graph_and_matches_the_reference(case, tmp_path, algorithm, preconditioner,
                                                                       averaging, halving):
    """The deterministic default (auto: the fixed-point one pass) captures the pass with the MAP step as one graph;
    within 1e-5 of the float64 reference of the same algorithm after 50 passes; the replayed graph and the same
    pass launched kernel by kernel give the same bits (with averaging: pass, the pass's mean formed in the step;
    with subset halving, 8 subsets per pass, then 4, 2 and 1, each level's pass captured anew)."""
    ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0, algorithm=algorithm, preconditioner=preconditioner,
                     averaging=averaging, subset_halving=halving)
    ref, _ = _run(case, tmp_path / "ref.h5", 50, ms, backend="cpu", reference_mode=True, threads=1)
    img, t = _run(case, tmp_path / "g.h5", 50, ms, backend="cuda")
    assert t["backend"]["map"]["step"] == "device" and t["map"]["averaging"] == averaging
    assert t["backend"]["graph"] is True
    assert t["deterministic"]
    assert rel(img.astype(np.float64), ref.astype(np.float64)) < 1e-5
    eager, t2 = _run(case, tmp_path / "e.h5", 50, ms, backend="cuda", graph=False)
    assert not t2["backend"].get("graph")
    assert np.array_equal(img, eager)


@pytest.mark.parametrize("halving", [(), (2, 4, 6)])
def test_float_atomics_with_the_step_match_the_reference(case, tmp_path, halving):
    """The step after the float32 back projection (onepass, float atomics) as well, with the subsets' float back
    projections summed where the subsets halve."""
    ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0, subset_halving=halving)
    ref, _ = _run(case, tmp_path / "ref.h5", 50, ms, backend="cpu", reference_mode=True, threads=1)
    img, t = _run(case, tmp_path / "a.h5", 50, ms, backend="cuda", fp="auto", bp="onepass")
    assert t["backend"]["map"]["step"] == "device"
    assert rel(img.astype(np.float64), ref.astype(np.float64)) < 1e-5


def test_the_gpu_pass_mean_is_the_cpu_one(case, tmp_path):
    """The pass's mean formed in the GPU step (the sub-iterates summed in order, divided by S), with the fastest
    settings measured on madpet2: within 1e-5 of the float64 run of the same settings after 20 passes, and
    not the last sub-iterate (the GPU run with averaging: last is 1e-4 or more away)."""
    ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0, preconditioner="hessian", preconditioner_offset=0.35,
                     relaxation=(1.0, 20.0), averaging="pass")
    ref, _ = _run(case, tmp_path / "ref.h5", 20, ms, backend="cpu", reference_mode=True, threads=1)
    gpu, t = _run(case, tmp_path / "gpu.h5", 20, ms, backend="cuda")
    assert t["backend"]["map"]["step"] == "device"
    assert rel(gpu.astype(np.float64), ref.astype(np.float64)) < 1e-5
    last, _ = _run(case, tmp_path / "last.h5", 20, dataclasses.replace(ms, averaging="last"), backend="cuda")
    assert rel(last.astype(np.float64), gpu.astype(np.float64)) > 1e-4


@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("bp,averaging,halving", [("onepass_fixed", "last", ()), ("onepass_chunked", "pass", ()),
                                                  ("onepass_fixed", "pass", (5, 10, 20))])
def test_two_gpus_give_the_bits_of_one(case, tmp_path, bp, averaging, halving):
    """The fixed-point kernels (the same bits on every GPU count): BSREM with subsets on 2 GPUs (the peer exchange
    fused with the step: each GPU sums and steps its slice of the voxels) equals 1 GPU bit for bit (the pass's image the last sub-iterate or the mean; the
    subsets halving). (``auto`` picks the csr_vector pair on this problem, whose 2-GPU back projection adds two
    float partial sums: other last bits.)"""
    ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0, averaging=averaging, subset_halving=halving)
    one, _ = _run(case, tmp_path / "one.h5", 30, ms, backend="cuda", gpus=1, bp=bp)
    two, t = _run(case, tmp_path / "two.h5", 30, ms, backend="cuda", gpus=2, bp=bp)
    assert t["backend"]["map"]["step"] == "device"
    assert t["backend"]["exchange"] == "peer"  # in the captured pass, each GPU steps its slice of the voxels
    assert np.array_equal(one, two)


@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_without_subsets_take_the_step(case, tmp_path):
    """S = 1 on 2 GPUs (the N-GPU backend, the step after its all-reduce): within 1e-5 of the float64 reference."""
    ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0)
    ref, _ = _run(case, tmp_path / "ref.h5", 30, ms, subsets=1, backend="cpu", reference_mode=True, threads=1)
    img, t = _run(case, tmp_path / "two.h5", 30, ms, subsets=1, backend="cuda", gpus=2)
    assert t["backend"]["map"]["step"] == "device"
    assert rel(img.astype(np.float64), ref.astype(np.float64)) < 1e-5
