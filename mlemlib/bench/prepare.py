"""A benchmark case's matrix, prepared once through the library's stages and cached on disk (host only).

:func:`prepare` turns a :class:`~mlemlib.bench.cases.Case`'s matrix settings
into files in ``WORK/<key>/`` (``key`` from the settings, so that every case
with the same settings shares them and a rerun reuses them):

- ``matrix.h5`` — the matrix the kernels read: generated
  (:func:`mlemlib.scanner.generate`, in the case's format, folded and in its
  voxel order), made (:func:`~mlemlib.bench.synthetic.tor_host`) or converted
  (:func:`mlemlib.formats.convert`, :func:`mlemlib.fold.fold_file`); its rows
  shuffled (:func:`~mlemlib.bench.synthetic.shuffle_rows`) and/or renumbered by
  the reorder stage (:func:`mlemlib.reorder.reorder_file`, ``rows+voxels``);
  converted last to the case's format where a stage gave another;
- ``transpose.h5`` — ``A^T`` (:func:`mlemlib.transpose.transpose_file`,
  ScanTrans), where a kernel pair reads it;
- ``csr.h5`` — a CSR copy for the cuSPARSE reference where the format is
  another (not where cuSPARSE's 32-bit indices cannot hold the matrix);
- ``parts-{P}/`` — the partition plan of ``P`` GPUs
  (:func:`mlemlib.partition.partition_file`; with each GPU's ``A_k^T`` where a
  compressed matrix's pair reads it), made by :func:`partition` when a case
  first runs on ``P`` GPUs;
- ``norm.npy`` (column sums, as :func:`mlemlib.norm.source_column_sums` gives them) and
  ``g.npy`` (the noiseless measurement ``A x`` of a fixed positive image);
- with OSEM subsets (``prepare(..., subsets=S)``, S > 1: a directory of its
  own, keyed by the settings and S): ``matrix.h5``'s rows grouped by subset by
  the reorder stage itself (:func:`mlemlib.reorder.reorder_file` with
  ``subsets=S``: by projection angle where the matrix knows its scanner, else
  row ``i`` in subset ``i mod S``, :func:`mlemlib.subsets.labels_for`; the
  case's order kept inside each subset: ``rows+voxels`` for a reordered case,
  ``none`` otherwise), ``subset_bounds.npy`` (int64[S+1]) and
  ``subset_norms.npy`` (the subsets' sensitivities, float64 S x n,
  :func:`mlemlib.norm.sensitivities`, a folded row weighted by its multiplicity);
- ``prepared.json`` — the settings and the matrix's facts, written last: a
  directory without it is prepared again.

Intermediate files are removed once the next stage has written its own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib import registry
from mlemlib.bench.cases import CUSPARSE, Case
from mlemlib.formats.spec import matrix_format_of

log = logging.getLogger(__name__)

#: The default work directory of prepared matrices (git-ignored, beside the workflow's resources).
DEFAULT_WORK = Path("resources") / "bench"
#: Non-zeros per streamed block when computing the norm and the measurement.
CHUNK_NNZ = 1 << 24


@dataclass
class Prepared:
    """The files of one prepared matrix and its facts."""

    directory: Path
    matrix: Path
    transpose: Path | None
    csr: Path | None
    norm: Path
    g: Path
    facts: dict[str, Any] = field(default_factory=dict)
    #: S, and with S > 1 the subsets' row bounds and sensitivities (``subset_bounds.npy``, ``subset_norms.npy``).
    subsets: int = 1
    bounds: Path | None = None
    subset_norms: Path | None = None

    def load_problem(self) -> tuple[np.ndarray, np.ndarray]:
        """``(g, norm)`` of the prepared matrix."""
        return np.load(self.g), np.load(self.norm)


def needs_transpose(case: Case, subsets: int = 1) -> bool:
    """Whether any pair of the case (the cuSPARSE reference included) reads a stored ``A^T``; with S > 1 subsets
    on the GPUs none does (each subset's GPUs transpose their own rows)."""
    if subsets > 1 and case.backend == "cuda":
        return False
    return any(registry.uses_transpose(case.backend, bp) for _, bp in case.pairs(subsets))


def matrix_facts(path: str | os.PathLike) -> dict[str, Any]:
    """Shape, stored non-zeros, format, bytes per non-zero of the file, folded or not, grid."""
    from mlemlib.fold import fold_of
    from mlemlib.formats import open_matrix

    src = open_matrix(path)
    try:
        m, n = (int(v) for v in src.shape)
        nnz = int(src.nnz)
        nbytes = getattr(src, "nbytes", None)
        if nbytes is None:
            nbytes = 8 * nnz + 8 * (m + 1)
        fold = fold_of(src)
        return {
            "shape": [m, n],
            "nnz": nnz,
            "format": matrix_format_of(src).name,
            "bytes": int(nbytes),
            "bytes_per_nnz": int(nbytes) / nnz if nnz else None,
            "folded": fold is not None,
            "user_rows": int(fold.m_user) if fold is not None else m,
            "grid": list(src.grid) if getattr(src, "grid", None) else None,
        }
    finally:
        close = getattr(src, "close", None)
        if close is not None:
            close()


def _test_image(n: int) -> np.ndarray:
    """A fixed positive image in [0.5, 1.5) (a hash of the voxel number), the source of ``g``."""
    j = np.arange(n, dtype=np.uint64)
    return 0.5 + ((j * np.uint64(2654435761)) % np.uint64(1000)).astype(np.float64) / 1000.0


def problem_arrays(matrix: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(g, norm)`` of a matrix (a path, an opened matrix or a CSRMatrix), in one streamed pass: ``g = A x``
    (float32) of :func:`_test_image`, a folded matrix's rows times their multiplicity, and the column sums
    (float64, :func:`mlemlib.norm.accumulate_column_sums`, a folded matrix's rows weighted likewise)."""
    from mlemlib.backends.cpu import spmv as host_spmv
    from mlemlib.fold import stored_row_weights
    from mlemlib.formats import open_source
    from mlemlib.matrix import CSRMatrix
    from mlemlib.norm import ColumnScratch, accumulate_column_sums

    src = open_source(matrix)
    try:
        m, n = (int(v) for v in src.shape)
        name = str(getattr(src, "source", None) or getattr(src, "path", None) or "<matrix>")
        x = _test_image(n)
        g = np.zeros(m, dtype=np.float64)
        norm = np.zeros(n, dtype=np.float64)
        weights = stored_row_weights(src)
        scratch = ColumnScratch()
        for r0, r1, block in src.iter_chunks(CHUNK_NNZ, reuse=True):
            if isinstance(block, CSRMatrix):  # each row summed in float64 in its order, on every core
                host_spmv(block.indptr, block.indices, block.data, x, g[r0:r1])
            else:
                g[r0:r1] = block.to_scipy() @ x
            accumulate_column_sums(norm, block, source=name,
                                   row_weights=None if weights is None else weights[r0:r1], scratch=scratch)
        if weights is not None:
            g *= weights
    finally:
        close = getattr(src, "close", None)
        if close is not None and src is not matrix:
            close()
    return g.astype(np.float32), norm


class _Steps:
    """The chain of stages of one preparation: each writes a new file and removes its input if intermediate."""

    def __init__(self, directory: Path, threads: int | None) -> None:
        self.directory = directory
        self.threads = threads
        self.current: Path | None = None
        self.intermediate = False
        self.seconds: dict[str, float] = {}

    def path(self, name: str) -> Path:
        return self.directory / name

    def done(self, stage: str, out: Path, t0: float, *, intermediate: bool = True) -> None:
        self.seconds[stage] = round(time.perf_counter() - t0, 3)
        if self.current is not None and self.intermediate and self.current != out:
            self.current.unlink(missing_ok=True)
        self.current, self.intermediate = out, intermediate
        log.info("prepare: %s -> %s in %.1f s", stage, out, self.seconds[stage])


def _file_format(path: Path) -> str:
    from mlemlib.formats import open_matrix

    src = open_matrix(path)
    try:
        return matrix_format_of(src).name
    finally:
        close = getattr(src, "close", None)
        if close is not None:
            close()


def _source(case: Case, st: _Steps) -> None:
    """Stage 1: the matrix in its own order (generated, made or converted), folded where asked."""
    from mlemlib.fold import fold_file
    from mlemlib.formats import convert, write_matrix_h5

    spec = case.matrix
    shuffle = "shuffled" in case.order
    fmt = "csr" if shuffle else case.format
    t0 = time.perf_counter()
    if spec.preset is not None:
        from mlemlib.scanner import generate

        out = st.path("generated.h5")
        generate(spec.preset, out, rays=spec.rays, threads=st.threads, fmt=fmt, fold=case.fold,
                 voxel_order=case.voxel_order)
        st.done("generate", out, t0)
        return
    if spec.tor is not None:
        from mlemlib.bench.synthetic import tor_host

        out = st.path("tor.h5")
        a = tor_host(spec.tor, spec.width)
        nx, ny, nz = spec.tor[:3]
        write_matrix_h5(out, a, grid=[nx, ny, nz])
        del a
        st.done("tor", out, t0)
        if case.fold:
            t0 = time.perf_counter()
            folded = st.path("folded.h5")
            fold_file(out, folded, fmt="csr", threads=st.threads)
            st.done("fold", folded, t0)
        return
    out = st.path("converted.h5")
    if case.fold:
        fold_file(spec.path, out, fmt=fmt, threads=st.threads)
        st.done("fold", out, t0)
    else:
        convert(spec.path, out, fmt=fmt)
        st.done("convert", out, t0)


def _shuffle(case: Case, st: _Steps) -> None:
    """The rows in a seeded random order (the whole matrix in host memory once)."""
    from mlemlib.bench.synthetic import shuffle_rows
    from mlemlib.formats import open_matrix, write_matrix_h5

    t0 = time.perf_counter()
    src = open_matrix(st.current)
    try:
        a = src.read_rows(0, int(src.shape[0]))
        grid = list(src.grid) if getattr(src, "grid", None) else None
    finally:
        close = getattr(src, "close", None)
        if close is not None:
            close()
    shuffled, _ = shuffle_rows(a, case.seed)
    del a
    out = st.path("shuffled.h5")
    write_matrix_h5(out, shuffled, **({"grid": grid} if grid else {}))
    del shuffled
    st.done("shuffle", out, t0)


def _keep_voxels(out: Path, st: _Steps) -> Any:
    """The permutation of the reordered ``out``, its voxel half kept as ``voxel_perm.npy`` (what MAP's prior needs
    of the matrix's voxel order: a later format conversion keeps the matrix, not its permutation)."""
    from mlemlib.reorder import permutation_of

    perm = permutation_of(out)
    if perm is not None and perm.voxels is not None:
        np.save(st.path("voxel_perm.npy"), np.asarray(perm.voxels, dtype=np.int64))
    return perm


def _reorder(case: Case, st: _Steps) -> None:
    from mlemlib.reorder import reorder_file

    t0 = time.perf_counter()
    out = st.path("reordered.h5")
    reorder_file(st.current, out, "rows+voxels", threads=st.threads)
    _keep_voxels(out, st)
    st.done("reorder", out, t0)


def _group(case: Case, st: _Steps, subsets: int) -> tuple[np.ndarray, str]:
    """The rows grouped by the ``subsets`` OSEM subsets by the reorder stage (the case's locality order inside
    each for a reordered case, the rows' own order otherwise); returns the bounds and how the rows were assigned."""
    from mlemlib.reorder import reorder_file

    t0 = time.perf_counter()
    out = st.path("grouped.h5")
    mode = "rows+voxels" if "reordered" in case.order else "none"
    reorder_file(st.current, out, mode, threads=st.threads, subsets=subsets)
    perm = _keep_voxels(out, st)  # read here: a later format conversion keeps the matrix, not its permutation
    st.done(f"reorder ({mode}, {subsets} subsets)", out, t0)
    return np.asarray(perm.subsets, dtype=np.int64), perm.subset_method


def _finish(case: Case, st: _Steps, matrix: Path) -> None:
    """The last stage: the case's format (converted where a stage gave another), renamed to ``matrix.h5``."""
    from mlemlib.formats import convert

    t0 = time.perf_counter()
    if _file_format(st.current) != case.format:
        convert(st.current, matrix, fmt=case.format)
        st.done("convert", matrix, t0, intermediate=False)
    else:
        os.replace(st.current, matrix)
        st.current, st.intermediate = matrix, False


def prepare(case: Case, work: str | os.PathLike = DEFAULT_WORK, *, threads: int | None = None,
            force: bool = False, subsets: int = 1) -> Prepared:
    """The prepared files of ``case``'s matrix in ``work`` (made now unless a previous run left them).

    Parameters
    ----------
    case
        The case (its :meth:`~mlemlib.bench.cases.Case.matrix_settings` decide the directory).
    work
        The work directory.
    threads
        CPU threads of the stages (None: all).
    force
        Prepare again even where a previous run's files are there.
    subsets
        OSEM subsets S: with S > 1 the matrix's rows are grouped by subset (a directory of its own) and the
        subsets' sensitivities are computed.
    """
    settings = case.matrix_settings(subsets)
    directory = Path(work) / case.matrix_key(subsets)
    record = directory / "prepared.json"
    want_t = needs_transpose(case, subsets)
    want_csr = (case.cusparse and case.backend == "cuda" and not matrix_format_of(case.format).cusparse
                and subsets == 1)
    done = None
    if record.exists() and not force:
        try:
            done = json.loads(record.read_text())
        except (OSError, ValueError):
            done = None
        if done is not None and done.get("settings") != json.loads(json.dumps(settings, default=str)):
            done = None
    matrix = directory / "matrix.h5"
    if done is None:
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        st = _Steps(directory, threads)
        t_all = time.perf_counter()
        _source(case, st)
        if "shuffled" in case.order:
            _shuffle(case, st)
        if subsets > 1:
            bounds, method = _group(case, st, subsets)
        elif "reordered" in case.order:
            _reorder(case, st)
        _finish(case, st, matrix)
        t0 = time.perf_counter()
        g, norm = problem_arrays(matrix)
        np.save(directory / "g.npy", g)
        np.save(directory / "norm.npy", norm)
        st.done("norm and g", matrix, t0, intermediate=False)
        facts = matrix_facts(matrix)
        if subsets > 1:
            t0 = time.perf_counter()
            np.save(directory / "subset_bounds.npy", bounds)
            np.save(directory / "subset_norms.npy", subset_sensitivities(matrix, bounds))
            st.done("sensitivities", matrix, t0, intermediate=False)
            facts.update(subsets=subsets, subset_method=method,
                         subset_rows=[int(np.diff(bounds).min()), int(np.diff(bounds).max())])
        done = {"settings": settings, "facts": facts, "seconds": st.seconds,
                "prepare_s": round(time.perf_counter() - t_all, 3)}
        record.write_text(json.dumps(done, indent=2, default=str) + "\n")
    facts = done["facts"]
    transpose = directory / "transpose.h5"
    if want_t and not transpose.exists():
        from mlemlib.transpose import transpose_file

        t0 = time.perf_counter()
        transpose_file(matrix, transpose, "scantrans", threads=threads)
        log.info("prepare: transpose -> %s in %.1f s", transpose, time.perf_counter() - t0)
    csr = None
    if want_csr:
        if facts["nnz"] > registry.CUSPARSE_MAX_NNZ:
            facts = {**facts, "cusparse_refused": f"{facts['nnz']} non-zeros: beyond cuSPARSE's 32-bit indices"}
        else:
            csr = matrix if matrix_format_of(case.format).cusparse else directory / "csr.h5"
            if not csr.exists():
                from mlemlib.formats import convert

                t0 = time.perf_counter()
                convert(matrix, csr, fmt="csr")
                log.info("prepare: CSR copy -> %s in %.1f s", csr, time.perf_counter() - t0)
    elif case.cusparse and case.backend == "cuda" and subsets == 1:
        csr = matrix
    grouped = subsets > 1
    return Prepared(directory, matrix, transpose if want_t else None, csr, directory / "norm.npy",
                    directory / "g.npy", dict(facts), subsets,
                    directory / "subset_bounds.npy" if grouped else None,
                    directory / "subset_norms.npy" if grouped else None)


def subset_sensitivities(matrix: Any, bounds: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """``s^k_j`` (float64, S x n) of a matrix (a path or an opened matrix) whose subsets are the row ranges
    ``bounds``: :func:`mlemlib.norm.sensitivities`, each row weighted by ``weights`` (one per stored row; None: 1)
    times a folded row's multiplicity (:func:`mlemlib.fold.stored_row_weights`)."""
    from mlemlib.fold import stored_row_weights
    from mlemlib.formats import open_source
    from mlemlib.norm import sensitivities

    src = open_source(matrix)
    try:
        mult = stored_row_weights(src)
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            mult = w if mult is None else w * mult
        return sensitivities(src, bounds, mult, max_nnz=CHUNK_NNZ)
    finally:
        close = getattr(src, "close", None)
        if close is not None and src is not matrix:
            close()


def partition(case: Case, prep: Prepared, parts: int, *, threads: int | None = None) -> Path:
    """The plan of ``parts`` GPUs of the prepared matrix (``parts-{P}/plan.json``, made once), as the
    workflow's partition stage makes it: with the row blocks of ``A^T`` for the thesis layout, and each
    GPU's ``A_k^T`` (``part-{k}.h5``) where the matrix is compressed and a pair back-projects on a
    stored transpose in the local layout."""
    from mlemlib.partition import partition_file

    out = prep.directory / f"parts-{parts}"
    plan = out / "plan.json"
    if plan.exists():
        return plan
    local_t = (case.layout == "local" and not matrix_format_of(case.format).cusparse and prep.transpose is not None
               and any(registry.uses_transpose(case.backend, bp) for fp, bp in case.pairs() if (fp, bp) != CUSPARSE))
    transpose = prep.transpose if (local_t or case.layout == "thesis") else None
    t0 = time.perf_counter()
    partition_file(prep.matrix, transpose, parts, out, local_transpose=local_t, threads=threads)
    log.info("prepare: partition of %d parts%s -> %s in %.1f s", parts, " with each A_k^T" if local_t else "",
             out, time.perf_counter() - t0)
    return plan
