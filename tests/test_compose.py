"""Every combination of the configuration space runs within the contract, or is refused up front (issue 53).

The space is :func:`mlemlib.compose.space`: matrix format x fold x reorder x
OSEM subsets x factors (m and b or none) x every kernel choice of the
registry x (cuda) GPU counts x layouts x graphs, and MAP (BSREM, the RDP)
with every model, backend, GPU count and layout. For each combination either
:func:`mlemlib.compose.check` (the workflow's dry-run verdict) refuses it in
one line naming the setting, or it runs on the ``small`` preset (thin-ray
tubes, for speed) and its image is within 1e-5 (relative L2) of the float64
reference of the same model; deterministic kernels give the same bits on a
rerun, and the fixed-point ones (``any_gpu_count``) on 1 and 2 GPUs in the cuda tier. The matrix variants, the
measurement and the references are built once per session and shared by the
tests (and by xdist workers, through a lock file).

The CPU tier runs in CI; the cuda tier (``-m gpu``) on a GPU machine, on every GPU count the machine has
(``MLEM_COMPOSE_GPU_COUNTS=2``: the 2-GPU combinations alone, each fixed-point one's 1-GPU run made for its bits).
With ``MLEM_COMPOSE_RESULTS=FILE`` every outcome is appended to FILE as a JSON
line, from which ``python -m mlemlib.compose FILE ... > docs/combinations.md``
makes the table of docs/combinations.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mlemlib import compose
from mlemlib.formats import open_matrix
from mlemlib.image import read_image
from mlemlib.map import MapSettings
from mlemlib.problem import ModelSpec, RunSettings

#: Passes of each run (S sub-iterations each) and the contract's tolerance.
ITERS = 3
TOL = 1e-5
#: ``rdp-kappa``'s kappa file, in the variants' directory (its name in the settings until then).
KAPPA = "kappa.f32"
#: The MAP runs' prior: BSREM with the RDP, beta 0.01 of the small preset's mean sensitivity (its image after 3
#: passes is 2.6% from OSEM's: the prior's term is far above the tolerance), epsilon 1e-3 of the initial image.
#: (With beta 10 times larger, float32 BSREM amplified the rounding of OSEM S = 4 with m and b to 2e-5.)
#: ``rdp-offset``: the same prior with the hessian preconditioner and an offset (the MAP step's other branches);
#: ``rdp-mean``: the fastest settings measured on madpet2, each pass's image the mean of its sub-iterates;
#: ``osl``: the same RDP with OSL; ``rdp-kappa``: with per-voxel weights kappa (uniform in [0.5, 1.5], the file
#: ``kappa.f32`` in the user's voxel order, which a reordered matrix's prior permutes); ``quadratic``: BSREM with
#: the quadratic prior, beta 0.05 (its image after 3 passes 13% from OSEM's on the folded, reordered CSR matrix
#: with 4 subsets, m and b; 11% with beta 0.005).
MAP = {"rdp": MapSettings("rdp", beta=0.5, gamma=2.0, epsilon=0.006),
       "rdp-offset": MapSettings("rdp", beta=0.5, gamma=2.0, epsilon=0.006, preconditioner="hessian",
                                 preconditioner_offset=0.23),
       "rdp-mean": MapSettings("rdp", beta=0.5, gamma=2.0, epsilon=0.006, preconditioner="hessian",
                               preconditioner_offset=0.35, relaxation=(1.0, 20.0), averaging="pass"),
       "rdp-halving": MapSettings("rdp", beta=0.5, gamma=2.0, epsilon=0.006, subset_halving=compose.HALVING),
       "osl": MapSettings("rdp", beta=0.5, gamma=2.0, epsilon=0.006, algorithm="osl"),
       "rdp-kappa": MapSettings("rdp", beta=0.5, gamma=2.0, epsilon=0.006, kappa=KAPPA),
       "quadratic": MapSettings("quadratic", beta=0.05)}


def _map(root: Path, prior: str) -> MapSettings | None:
    """The MAP settings of ``prior`` (None: MLEM/OSEM), a kappa file in the variants' directory."""
    ms = MAP.get(prior)
    return ms if ms is None or ms.kappa != KAPPA else dataclasses.replace(ms, kappa=root / KAPPA)


def _build(root: Path) -> None:
    """The ``small`` preset (rays 1), its 32 variants (format x fold x reorder x S) and one realistic measurement."""
    from mlemlib.fold import fold_file
    from mlemlib.formats import convert
    from mlemlib.phantom import ScannerEffects, simulate
    from mlemlib.reorder import reorder_file
    from mlemlib.scanner import generate

    generate("small", root / "small.csr4", rays=1)
    convert(root / "small.csr4", root / "small.h5")
    with open_matrix(root / "small.h5") as src:
        voxels = int(src.shape[1])
    np.random.default_rng(3).uniform(0.5, 1.5, voxels).astype("<f4").tofile(root / KAPPA)
    effects = ScannerEffects(attenuation=True, normalisation_spread=0.1, randoms_fraction=0.2, scatter_fraction=0.3)
    simulate(root / "small.h5", "nema", root / "g.LMsino", None, seed=1, counts=1_000_000, supersample=1,
             effects=effects, out_multiplicative=root / "m.f32", out_additive=root / "b.f32")
    for fmt in compose.FORMATS:
        for fold in (False, True):
            base = root / f"{fmt}-{int(fold)}.h5"
            if fold:
                fold_file(root / "small.h5", base, fmt=fmt)
            else:
                convert(root / "small.csr4", base, fmt=fmt)
            for reorder in compose.REORDERS:
                for s in compose.SUBSETS:
                    if reorder != "none" or s > 1:
                        reorder_file(base, _matrix(root, fmt, fold, reorder, s), reorder, subsets=s)


def _matrix(root: Path, fmt: str, fold: bool, reorder: str, subsets: int) -> Path:
    if reorder == "none" and subsets == 1:
        return root / f"{fmt}-{int(fold)}.h5"
    return root / f"{fmt}-{int(fold)}-{reorder.replace('+', '')}-S{subsets}.h5"


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """The space's lock, held by one worker (or process) at a time while it builds a shared file."""
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def space_files(tmp_path_factory) -> Path:
    """The shared directory of the variants (built by the first worker that gets the lock)."""
    # under xdist every worker's base is a folder of the session's: its parent is shared by the workers and
    # new each session; without xdist the base is the session's own folder
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "compose-space"
    root.mkdir(exist_ok=True)
    with _locked(root):
        if not (root / ".done").exists():
            _build(root)
            (root / ".done").touch()
    return root


def _factors(root: Path, factors: bool) -> dict:
    return {"multiplicative": root / "m.f32", "additive": root / "b.f32"} if factors else {}


def _reference(root: Path, model: tuple, prior: str = "none") -> np.ndarray:
    """The float64 reference of a model (its matrix variant, S, factors) with ``prior`` (MAP) or none, computed once
    (under the lock)."""
    from mlemlib.mlem import reference

    fmt, fold, reorder, s, factors = model
    path = root / f"ref-{fmt}-{int(fold)}-{reorder.replace('+', '')}-S{s}-{int(factors)}-{prior}.h5"
    with _locked(root):
        if not path.exists():
            tmp = path.with_suffix(".tmp.h5")
            model = ModelSpec(_matrix(root, fmt, fold, reorder, s), root / "g.LMsino", subsets=s,
                              map=_map(root, prior), **_factors(root, factors))
            reference(model, RunSettings(ITERS, checkpoint_every=0), tmp)
            os.replace(tmp, path)
    return read_image(path)[0].astype(np.float64)


def _transpose(root: Path, matrix: Path) -> Path:
    """The stored ``A^T`` of a matrix variant (``mlem transpose``), made once (under the lock)."""
    from mlemlib.transpose import transpose_file

    path = matrix.with_name(matrix.stem + "-T.h5")
    with _locked(root):
        if not path.exists():
            tmp = path.with_suffix(".tmp.h5")
            transpose_file(matrix, tmp, "scantrans")
            os.replace(tmp, path)
    return path


def _parts(root: Path, matrix: Path, parts: int) -> Path:
    """The partition of a matrix variant into ``parts`` row blocks with each block's ``A_k^T`` in its part file
    (``mlem partition --local-transpose``), made once (under the lock): its ``plan.json``."""
    from mlemlib.partition import partition_file

    out = matrix.with_name(f"{matrix.stem}-parts{parts}")
    transpose = _transpose(root, matrix)  # (takes the lock itself)
    with _locked(root):
        if not (out / "plan.json").exists():
            partition_file(matrix, transpose, parts, out, local_transpose=True)
    return out / "plan.json"


def _run(root: Path, c: compose.Combination, out: Path) -> np.ndarray:
    """The run as the workflow makes it: its matrix variant, the transpose where it reads one, the partition's
    part files where it reads them, its model."""
    from mlemlib.backends import graph_option
    from mlemlib.mlem import reconstruct

    fmt, fold, reorder, s, factors = c.model
    matrix = _matrix(root, fmt, fold, reorder, s)
    transpose = _transpose(root, matrix) if compose.reads_transpose(c) else None
    plan = _parts(root, matrix, c.gpus) if compose.needs_part_files(c) else None
    model = ModelSpec(matrix, root / "g.LMsino", transpose=transpose, subsets=s, map=_map(root, c.prior),
                      **_factors(root, factors))
    settings = RunSettings(ITERS, checkpoint_every=0, backend=c.backend, fp=c.fp, bp=c.bp, gpus=c.gpus,
                           layout=c.layout, graph=graph_option(None if c.graph == "auto" else False), plan=plan)
    reconstruct(model, settings, out, raw_out=False)
    return read_image(out)[0]


def _note(c: compose.Combination, outcome: str, detail: str = "") -> None:
    path = os.environ.get("MLEM_COMPOSE_RESULTS")
    if path:
        compose.record(path, c, outcome, detail)


def _check_model(space_files: Path, tmp_path: Path, model: tuple, backend: str, gpu_counts=(1,)) -> None:
    """Every combination of one model on one backend: refused in one line, or within TOL and repeatable."""
    combos = [c for c in compose.space([backend], gpu_counts) if c.model == model]
    assert combos
    priors = os.environ.get("MLEM_COMPOSE_PRIORS")  # e.g. "map": the MAP combinations alone, "rdp,osl": those
    if priors:
        asked = set(priors.split(","))
        combos = [c for c in combos if c.prior in asked or ("map" in asked and c.prior != "none")]
        if not combos:
            pytest.skip(f"MLEM_COMPOSE_PRIORS={priors}: no combination of this model")
    refs: dict[str, np.ndarray] = {}
    failures = []
    bits: dict[tuple, np.ndarray] = {}
    for i, c in enumerate(combos):
        refusal = compose.verdict(c)
        if refusal is not None:
            assert "\n" not in refusal and refusal.split(":")[0].startswith("run."), refusal
            _note(c, "refused", refusal)
            continue
        if c.prior not in refs:
            refs[c.prior] = _reference(space_files, model, c.prior)
        ref = refs[c.prior]
        try:
            img = _run(space_files, c, tmp_path / f"{i}.h5").astype(np.float64)
            err = float(np.linalg.norm(img - ref) / np.linalg.norm(ref))
            if not err <= TOL:
                raise AssertionError(f"relative L2 {err:.2e} to the float64 reference (contract {TOL:g})")
            key = (c.fp, c.bp, c.layout, c.graph, c.prior)
            if _any_gpu_count(c):
                if key not in bits and c.gpus > 1:  # the tier without its 1-GPU runs: this one's, for the bits
                    one = dataclasses.replace(c, gpus=1, layout="local")
                    bits[key] = _run(space_files, one, tmp_path / f"{i}-one.h5").astype(np.float64)
                if key in bits and not np.array_equal(bits[key], img):
                    raise AssertionError(f"{c.gpus} GPUs give other bits than 1")
            bits.setdefault(key, img)
            _note(c, "ran", f"{err:.1e}")
        except Exception as exc:  # noqa: BLE001 - every failure is collected and reported with its combination
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if isinstance(exc, AssertionError) and "relative L2" in why:
                why += "; " + _diagnose(img, ref) + "; " + _run_again(space_files, c, tmp_path / f"{i}-again.h5", ref)
            _note(c, "FAILED", why)
            failures.append(f"{c.label()}: {why}")
    assert not failures, "\n".join(failures)


def _diagnose(img: np.ndarray, ref: np.ndarray) -> str:
    """Where an image that missed the contract is off: its NaN voxels and those more than 1% from the reference."""
    off = ~np.isclose(img, ref, rtol=1e-2, atol=1e-2 * float(np.abs(ref).max()))
    return f"{int(np.isnan(img).sum())} NaN voxels, {int(off.sum())} of {img.size} more than 1% off"


def _run_again(root: Path, c: compose.Combination, out: Path, ref: np.ndarray) -> str:
    """The same combination run once more in this process: whether a miss repeats (a fault of the setting) or not
    (an intermittent one). The failure stands either way."""
    try:
        again = _run(root, c, out).astype(np.float64)
    except Exception as exc:  # noqa: BLE001 - reported in the failure's line
        return f"run again: {type(exc).__name__}"
    return f"run again: relative L2 {float(np.linalg.norm(again - ref) / np.linalg.norm(ref)):.2e}"


def _any_gpu_count(c: compose.Combination) -> bool:
    """Whether the combination's image is the same bits on every GPU count (the fixed-point kernels; ``auto``
    may pick another)."""
    from mlemlib import registry

    return c.bp != "auto" and registry.get_bp(c.backend, c.bp).any_gpu_count


MODELS = list(compose.models())


def _id(model: tuple) -> str:
    fmt, fold, reorder, s, factors = model
    return f"{fmt}-{'fold' if fold else 'nofold'}-{reorder}-S{s}-{'mb' if factors else 'plain'}"


@pytest.mark.parametrize("model", MODELS, ids=[_id(m) for m in MODELS])
def test_cpu_combinations_run_within_the_contract_or_are_refused(space_files, tmp_path, model):
    _check_model(space_files, tmp_path, model, "cpu")


def test_cpu_runs_repeat_bit_for_bit(space_files, tmp_path):
    """A rerun of deterministic CPU runs (every CPU kernel is) gives the same image bits."""
    for c in (compose.Combination("compressed", True, "rows+voxels", 4, True, "cpu", "auto", "auto"),
              compose.Combination("csr", False, "none", 1, False, "cpu", "auto", "onepass_chunked")):
        assert compose.verdict(c) is None
        first = _run(space_files, c, tmp_path / "a.h5")
        assert np.array_equal(first, _run(space_files, c, tmp_path / "b.h5")), c.label()


def test_part_files_where_the_workflow_gives_them(space_files):
    """needs_part_files: the runs whose GPUs read their A_k^T from the partition's part files (a compressed matrix,
    several GPUs in the local layout, no subsets, a bp on A^T); the harness's partition holds them, one per GPU, and
    together they hold A's non-zeros once (a 2-GPU run without them failed inside the job, first seen on 2 H200s)."""
    from mlemlib.formats import open_matrix
    from mlemlib.partition import read_plan

    def combo(**kw):
        base = {"format": "compressed", "fold": False, "reorder": "none", "subsets": 1, "factors": False,
                "backend": "cuda", "fp": "auto", "bp": "delta_vector", "gpus": 2, "layout": "local"}
        return compose.Combination(**{**base, **kw})

    assert compose.needs_part_files(combo()) and compose.needs_part_files(combo(bp="auto"))
    assert not compose.needs_part_files(combo(format="csr"))  # a GPU transposes its CSR block itself
    assert not compose.needs_part_files(combo(subsets=4))
    assert not compose.needs_part_files(combo(layout="thesis"))
    assert not compose.needs_part_files(combo(bp="onepass_fixed"))
    assert not compose.needs_part_files(combo(gpus=1)) and compose.needs_part_files(combo(gpus=1, graph="on"))
    assert not compose.needs_part_files(combo(gpus=1, graph="on", bp="auto"))
    matrix = _matrix(space_files, "compressed", False, "none", 1)
    plan = read_plan(_parts(space_files, matrix, 2))
    with open_matrix(matrix) as a:
        nnz, n = a.nnz, a.shape[1]
    total = 0
    for k, part in enumerate(plan["local_transpose"]):
        r0, r1 = plan["rows"][k]
        with open_matrix(part) as pt:
            assert pt.shape == (n, r1 - r0)
            total += pt.nnz
    assert len(plan["local_transpose"]) == 2 and total == nnz


def test_the_table_counts_what_no_tier_ran():
    """docs/combinations.md's counts: a combination without a result is "not run", whether its whole execution
    was never run or a tier stopped before its model (here: 3 planned on 2 GPUs, one ran, one failed, one not
    reached; one execution on 1 GPU never run)."""
    run = compose.Combination("csr", False, "none", 1, False, "cuda", "auto", "auto", gpus=2)
    failed = dataclasses.replace(run, subsets=4)
    unreached = dataclasses.replace(run, fold=True)
    never = dataclasses.replace(run, gpus=1)
    lines = []
    for c, outcome in ((run, "ran"), (failed, "FAILED")):
        lines.append(json.dumps({**dataclasses.asdict(c), "outcome": outcome, "detail": "1e-7" if outcome == "ran"
                                 else "ValueError: x"}))
    table = compose.table(lines, planned=[run, failed, unreached, never])
    assert "| cuda | 1 | 1 | 0 | 0 | 0 | 1 |" in table
    assert "| cuda | 2 | 3 | 1 | 0 | 1 | 1 |" in table
    row = next(ln for ln in table.splitlines() if ln.startswith("| cuda | auto / auto | 2, local"))
    assert row.startswith("| cuda | auto / auto | 2, local, graph auto | 1 | 0 | 1 |")
    assert "failed: ValueError: x (1 of 64: csr; S4)" in row and "not run yet: 1 of its models" in row
    assert "| cuda | auto / auto | 1, graph auto | - | - | - | not run yet |" in table
    # the failed one run again (a later tier's line): counted once, with its last outcome
    again = compose.table([*lines, json.dumps({**dataclasses.asdict(failed), "outcome": "ran", "detail": "2e-7"})],
                          planned=[run, failed, unreached, never])
    assert "| cuda | 2 | 3 | 2 | 0 | 0 | 1 |" in again


def test_every_refusal_names_a_setting_in_one_line():
    """The verdicts over the whole space (cuda included): each refusal one line naming ``run.<key>``."""
    refused = [(c, compose.verdict(c)) for c in compose.space()]
    refused = [(c, v) for c, v in refused if v is not None]
    assert refused
    keys = {v.split(":")[0] for _, v in refused}
    assert keys <= {"run.fp", "run.bp", "run.gpus", "run.layout", "run.backend", "run.subsets"}, keys
    # MAP composes with everything: a MAP run is refused exactly where the same run without the prior is; the
    # subset schedule runs on every backend with S divisible by 4, and is refused elsewhere naming S
    maps = [c for c in compose.space() if c.prior not in ("none", "rdp-halving")]
    assert maps
    assert all(compose.verdict(c) == compose.verdict(dataclasses.replace(c, prior="none")) for c in maps)
    for c in (c for c in compose.space() if c.prior == "rdp-halving"):
        v, plain = compose.verdict(c), compose.verdict(dataclasses.replace(c, prior="none"))
        if plain is not None:
            assert v == plain
        elif c.subsets % 4:
            assert v.startswith("run.subsets: mlem.subset_halving: 2 halvings of 1 subsets"), v
        else:
            assert v is None
    assert all("\n" not in v for _, v in refused)


@pytest.mark.gpu
@pytest.mark.parametrize("model", MODELS, ids=[_id(m) for m in MODELS])
def test_cuda_combinations_run_within_the_contract_or_are_refused(space_files, tmp_path, model):
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        pytest.skip("no GPU")
    counts = tuple(g for g in compose.GPU_COUNTS if g <= gpus)
    asked = os.environ.get("MLEM_COMPOSE_GPU_COUNTS")  # e.g. "2": the 2-GPU combinations alone
    if asked:
        counts = tuple(g for g in counts if str(g) in asked.split(","))
        if not counts:
            pytest.skip(f"MLEM_COMPOSE_GPU_COUNTS={asked}: none of them on this machine")
    _check_model(space_files, tmp_path, model, "cuda", gpu_counts=counts)


@pytest.mark.parametrize(
    ("fmt", "subsets", "graph", "bp", "reads"),
    [
        ("compressed", 1, "on", "delta_vector", False),  # the several-GPU backend: A_k^T from the part files
        ("compressed", 1, "auto", "delta_vector", True),
        ("compressed", 1, "on", "auto", True),  # auto: a one pass or the pair, never the part files
        ("compressed", 4, "on", "delta_vector", True),  # OSEM: each subset's GPU transposes (or is refused)
        ("csr", 1, "on", "csr_vector", False),  # a GPU transposes CSR itself
    ],
)
def test_a_one_gpu_run_reads_the_stored_transpose_as_the_workflow_gives_it(fmt, subsets, graph, bp, reads):
    """The workflow's graph: true on one GPU with a named A^T kernel reads the partition's part files instead."""
    c = compose.Combination(fmt, False, "none", subsets, False, "cuda", "auto", bp, gpus=1, graph=graph)
    assert compose.reads_transpose(c) is reads
