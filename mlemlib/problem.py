"""One MLEM problem, loaded: the opened matrices, the measurement, the norm, and what a run is measured against.

:func:`load_problem` opens the system matrix (and ``A^T`` where given), reads
the measurement ``g`` (in the user's LOR order: folded into the stored rows of
a folded matrix, permuted for a reordered one), reads or computes the norm,
fingerprints the problem (:mod:`mlemlib.provenance`) and loads the reference
and truth images (in the user's voxel order), returning a :class:`Problem`.
What :func:`mlemlib.mlem.reconstruct` reconstructs is a :class:`ModelSpec` (the
matrix, the measurement, the norm, ``A^T``, the subsets, ``m``, ``b``, the
prior), how it runs it a :class:`RunSettings` (iterations, repetitions,
checkpoints, the backend and its kernels, GPUs, layout, graphs, the float64
reference); both are validated when made. Host memory; every backend.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from mlemlib.checkpoint import checkpoint_key
from mlemlib.corrections import Corrections
from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.fold import fold_of
from mlemlib.formats import open_source
from mlemlib.image import plain_attr, read_image
from mlemlib.norm import source_column_sums
from mlemlib.provenance import problem_fingerprint, source_name
from mlemlib.reorder import (
    Permutation,
    image_to_permuted_order,
    image_to_user_order,
    permutation_of,
    to_permuted_measurement,
)
from mlemlib.timing import Stopwatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """What is reconstructed: the forward model ``ybar = m * (A f) + b`` of a measurement ``g``, and its prior.

    The inputs that define the problem (its fingerprint, :func:`load_problem`); how it is run is
    :class:`RunSettings`. Paths, opened matrices or arrays, as :func:`load_problem` reads them; a new model
    term is a field here and a step in :func:`load_problem` (and the backend that uses it).

    Attributes
    ----------
    matrix
        System matrix ``A``: a path (``.h5``, ``.csr4``, ``.mtx``, ``.npz``), an opened matrix or a CSRMatrix.
        A reordered container (``mlem reorder``) is reconstructed in its permuted space, transparently: the
        measurement, the factors and a norm given as an array are in the user's order, the image written is
        in the user's voxel order (:mod:`mlemlib.reorder`); a folded one (:mod:`mlemlib.fold`) as
        transparently.
    sino
        Measurement ``g``: a ``.LMsino`` path or an array of m counts, in the user's LOR order.
    norm
        ``norm.h5`` path or array (float64, n); None computes the column sums (the sensitivities with subsets
        or ``m``). For a reordered matrix a ``norm.h5`` must be that of the reordered matrix, an array is in
        the user's voxel order.
    transpose
        ``transpose.h5`` path, opened matrix or CSRMatrix of ``A^T`` (of the reordered matrix for a reordered
        one); None back-projects with ``A``.
    subsets, subset_file
        OSEM subsets S (1: MLEM; :mod:`mlemlib.subsets`), or a user's subset file (one little-endian int32
        per LOR). The matrix's rows must be grouped by them (``mlem reorder --subsets S``).
    multiplicative, additive
        The measurement's factors ``m`` and background ``b`` (:func:`mlemlib.corrections.read_factors`: raw
        float32 per LOR in the user's order, ``file.h5:/dataset``, or arrays); None: m = 1, b = 0.
    map
        None (MLEM, OSEM), or a :class:`mlemlib.map.MapSettings`: MAP with its prior and algorithm (BSREM,
        OSL); the matrix needs a voxel grid.
    matrix_name, data_name
        The matrix's and the measurement's names in tables (default: from the matrix's path; the
        measurement's file name without the suffix).

    Raises
    ------
    ConfigError
        A bad subset count or MAP settings (one line), when the value is made.
    """

    matrix: Any
    sino: Any
    norm: Any = None
    transpose: Any = None
    subsets: int = 1
    subset_file: Any = None
    multiplicative: Any = None
    additive: Any = None
    map: Any = None
    matrix_name: str | None = None
    data_name: str | None = None

    def __post_init__(self) -> None:
        from mlemlib.subsets import check_count

        object.__setattr__(self, "subsets", check_count(self.subsets))
        if self.map is not None:
            object.__setattr__(self, "map", self.map.check())

    @classmethod
    def of_job(cls, inputs: Any, params: Any, *, matrix_name: str | None = None,
               data_name: str | None = None) -> ModelSpec:
        """The model of a workflow job (``run_mlem``, ``reference_mlem``, ``compute_converged_map``): its named
        ``inputs`` (``matrix``, ``sino``; ``norm``, ``transpose`` and ``subset_file`` where the job has them)
        and the model part of its ``params`` (``subsets``, ``factors``: role -> file, ``map``: the
        :class:`mlemlib.map.MapSettings` fields where there is a prior), as the rules' ``get_problem_input``
        and ``get_model_params`` give them."""
        from mlemlib.map import MapSettings

        factors = params["factors"]
        return cls(inputs.matrix, inputs.sino, norm=inputs.get("norm"), transpose=inputs.get("transpose"),
                   subsets=params["subsets"], subset_file=inputs.get("subset_file"),
                   multiplicative=factors.get("multiplicative"), additive=factors.get("additive"),
                   map=MapSettings(**params["map"]) if "map" in params else None,
                   matrix_name=matrix_name, data_name=data_name)

    @property
    def sources(self) -> dict[str, Any]:
        """The model's inputs by the names ``timings.json`` records them under."""
        return {"matrix": self.matrix, "sino": self.sino, "norm": self.norm, "transpose": self.transpose}


@dataclass(frozen=True)
class RunSettings:
    """How one :func:`mlemlib.mlem.reconstruct` call runs its :class:`ModelSpec`: validated when made.

    Attributes
    ----------
    iterations
        Iterations per repetition (>= 0; with subsets or MAP an iteration is a pass over the subsets).
    repetitions
        Times the reconstruction is repeated (the matrix loaded once), each timed and measured separately.
    checkpoint_every
        Save the image every K iterations (0 or None: never); a killed run resumes from it.
    backend, fp, bp, secsize, graph, gpus, layout, plan, threads, chunks
        The backend and its kernels (:func:`mlemlib.backends.make_backend`): ``backend`` auto, cpu or cuda;
        ``graph`` None lets the backend decide (CUDA graphs on several GPUs and for OSEM where the kernels
        can be captured); ``plan`` a partition (gpus > 1); ``chunks`` the matrix's row chunks as a layout
        file of ``mlem chunk`` (the chunked one pass).
    reference_mode
        Compute the float64 reference instead (:func:`mlemlib.mlem.reference`): the cpu backend in float64,
        ``fp``/``bp`` None as ``auto`` (the cpu backend resolves them: ``numba`` on every thread given,
        ``scipy`` on one); one GPU count only (1).

    Raises
    ------
    ConfigError
        A bad count, an unknown backend or layout, or a GPU count with ``reference_mode`` (one line naming
        the setting), when the value is made: before any work.
    """

    iterations: int
    repetitions: int = 1
    checkpoint_every: int = 10
    backend: str = "auto"
    fp: str = "auto"
    bp: str = "auto"
    secsize: int | None = None
    graph: bool | None = None  # None: auto (the backend decides: on for several GPUs where its kernels allow)
    gpus: int = 1
    layout: str = "local"
    plan: Any = None
    threads: int | None = None
    chunks: Any = None
    reference_mode: bool = False

    def __post_init__(self) -> None:
        from mlemlib.backends import get_backend_name
        from mlemlib.registry import check_layout

        put = partial(object.__setattr__, self)
        put("iterations", check_int("iterations", self.iterations, 0))
        put("repetitions", check_int("repetitions", self.repetitions, 1))
        put("checkpoint_every", check_int("checkpoint_every", self.checkpoint_every or 0, 0))
        put("graph", None if self.graph is None else bool(self.graph))
        put("reference_mode", bool(self.reference_mode))
        if self.reference_mode:
            if self.gpus not in (None, 1):
                raise ConfigError("gpus", "the reference runs on the cpu (gpus 1)")
            put("backend", "cpu")
            put("gpus", 1)
            put("fp", "auto" if self.fp is None else self.fp)
            put("bp", "auto" if self.bp is None else self.bp)
        if self.backend != "auto":
            get_backend_name(self.backend)  # an unknown name: one line (auto is resolved by the backend)
        put("gpus", 1 if self.gpus is None else check_int("gpus", self.gpus, 1))
        check_layout(self.layout)

    @property
    def dtype(self) -> np.dtype:
        """The iteration's floating type: float64 for the reference, float32 otherwise."""
        return np.dtype(np.float64 if self.reference_mode else np.float32)


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a one-line :class:`ConfigError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < minimum:
        raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclass
class Problem:
    """One loaded MLEM problem: the opened matrices, ``g``, the norm, and what it is measured against."""

    src: Any
    tsrc: Any
    g: np.ndarray
    norm: np.ndarray
    fingerprint: str
    key: str
    reference: np.ndarray | None
    truth: np.ndarray | None
    regions: Any
    grid: Any
    voxel_size: Any
    load_s: float
    #: The permutation of a reordered matrix (None otherwise): ``g``, ``norm`` and
    #: the iterated images are in its permuted order; ``reference``, ``truth`` and
    #: ``regions`` stay in the user's order.
    perm: Permutation | None = None
    #: The row fold of a folded matrix (None otherwise): ``g`` is folded into its stored rows.
    row_fold: Any = None
    #: Subsets, background and factors (in the permuted row order); the default is MLEM.
    corrections: Corrections = field(default_factory=Corrections)
    #: The model's MAP term (:class:`mlemlib.map.MapSettings`), or None: MLEM/OSEM.
    map: Any = None

    @property
    def reorder(self) -> str:
        """The reorder mode of the matrix: ``none``, ``rows`` or ``rows+voxels``."""
        return "none" if self.perm is None else self.perm.mode

    def to_user(self, image: np.ndarray) -> np.ndarray:
        """A host image of the iteration (permuted order) in the user's voxel order."""
        if self.perm is None:
            return image
        return np.ascontiguousarray(image_to_user_order(image, self.perm))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(v) for v in self.src.shape)


def load_problem(opened: list[Any], model: ModelSpec, settings: RunSettings, *, reference: Any = None,
                 truth: Any = None) -> Problem:
    """Open the matrix (and ``A^T``), read ``g``, the corrections and the norm, fingerprint the problem, load
    reference and truth.

    Every reader opened here is appended to ``opened`` (the caller closes them,
    :func:`close_all`, also when this raises). ``settings`` gives the floating type (the norm per subset
    and ``b / m`` are in it; the checkpoint key names it) and the iteration count the reference must
    have. ``reference`` and ``truth`` are as :func:`mlemlib.mlem.reconstruct` takes them.
    """
    from mlemlib.formats import matrix_geometry

    matrix, norm, transpose = model.matrix, model.norm, model.transpose
    with Stopwatch() as sw_load:
        src = open_source(matrix, "matrix")
        if src is not matrix:
            opened.append(src)
        m, n = (int(v) for v in src.shape)
        g, row_fold, perm = stored_measurement(src, matrix, model.sino)
        corr = load_corrections(src, source_name(src, matrix), row_fold, perm, model, settings.dtype)
        if not corr.plain:
            norm_arr = corrected_norm(src, norm, corr, settings.dtype)
        elif norm is None:
            log.info("no norm given: computing the column sums of the matrix")
            norm_arr = source_column_sums(src)  # of the permuted matrix: in the permuted order
        elif isinstance(norm, (str, os.PathLike)):
            from mlemlib.norm import read_norm

            if perm is None:
                norm_arr = read_norm(norm, expected_length=n)
            else:
                norm_arr = read_permuted_norm(norm, n, src, perm, source_name(src, matrix))
        else:
            norm_arr = np.asarray(norm, dtype=np.float64).reshape(-1)
            if norm_arr.size != n:
                raise ConfigError("norm", f"norm has {norm_arr.size} values, the matrix has n = {n} columns")
            if perm is not None:  # an array is in the user's voxel order
                norm_arr = np.ascontiguousarray(image_to_permuted_order(norm_arr, perm))
        tsrc = None
        if transpose is not None:
            tsrc = open_source(transpose, "transpose")
            if tsrc is not transpose:
                opened.append(tsrc)
            if tuple(int(v) for v in tsrc.shape) != (n, m):
                raise MatrixFormatError(
                    source_name(tsrc, transpose), f"transpose has shape {tuple(tsrc.shape)}, expected (n, m) = {(n, m)}"
                )
            t_source = (getattr(tsrc, "attrs", None) or {}).get("source_checksum")
            if perm is not None and t_source and t_source == perm.source_checksum:
                raise MatrixFormatError(
                    source_name(tsrc, transpose),
                    f"transpose of the un-reordered matrix, but {source_name(src, matrix)} is reordered "
                    f"({perm.mode}); transpose the reordered matrix ('mlem transpose')",
                )
        problem = problem_fingerprint(src, g, problem_identity(corr, model.map))
        key = checkpoint_key(problem, norm_arr, settings.dtype)
        ref_img = load_reference(reference, n, problem, settings.iterations)
        truth_img, regions = load_truth(truth, n)
    grid, voxel_size = matrix_geometry(src)
    log.info("loaded problem %s: %d x %d, %d nnz (%.2f s)", problem[:12], m, n, int(src.nnz), sw_load.seconds)
    return Problem(src, tsrc, g, norm_arr, problem, key, ref_img, truth_img, regions, grid, voxel_size, sw_load.seconds,
                   perm, row_fold, corr, model.map)


def stored_measurement(src: Any, matrix: Any, sino: Any) -> tuple[np.ndarray, Any, Permutation | None]:
    """The measurement ``g`` (a ``.LMsino`` path or counts, in the user's LOR order) on the opened matrix's
    stored rows: summed per row of a folded matrix, permuted for a reordered one; with the fold and the
    permutation (None where there is none). ``matrix`` names the matrix in messages."""
    from mlemlib.formats.lmsino import check_counts, read_lmsino

    m, n = (int(v) for v in src.shape)
    row_fold = fold_of(src)
    m_user = m if row_fold is None else row_fold.m_user
    if isinstance(sino, (str, os.PathLike)):
        g = read_lmsino(sino, expected_length=m_user)
    else:
        g = check_counts(sino, "sino")
        if g.size != m_user:
            raise ConfigError("sino", f"measurement has {g.size} values, the matrix has m = {m_user} rows")
    if row_fold is not None:
        # g is in the user's LOR order: each stored row gets its LORs' summed counts.
        g = row_fold.fold(g)
        log.info("%s is folded: %d stored rows hold the %d LORs of the measurement (counts summed)",
                 source_name(src, matrix), m, m_user)
    perm = permutation_of(src)
    if perm is not None:
        if perm.shape != (m, n):
            raise MatrixFormatError(
                source_name(src, matrix), f"permutation of a {perm.m} x {perm.n} matrix, the matrix is {m} x {n}"
            )
        # g is in the user's LOR order; the problem (and its fingerprint) lives in the permuted space.
        g = to_permuted_measurement(g, perm)
        log.info("%s is reordered (%s): measurement and images are mapped between the user's and the "
                 "permuted order", source_name(src, matrix), perm.mode)
    return g, row_fold, perm


def problem_identity(corr: Corrections, map_settings: Any) -> str:
    """What the run models beyond MLEM, as the problem's fingerprint takes it: the corrections' identity and
    the MAP settings' (``map_settings``, None for MLEM; ``""`` for MLEM without corrections)."""
    parts = (corr.identity(), "" if map_settings is None else map_settings.identity())
    return ";".join(p for p in parts if p)


def load_corrections(src: Any, name: str, row_fold: Any, perm: Permutation | None, model: ModelSpec,
                     dtype: np.dtype) -> Corrections:
    """The model's subsets (their rows must be grouped: ``mlem reorder --subsets``) and its factors ``m`` and
    ``b``, read in the user's LOR order and taken to the matrix's rows: on a folded matrix summed over each
    stored row's LORs (:func:`mlemlib.corrections.summed_factors`), then permuted; ``b / m`` in ``dtype``."""
    from mlemlib.corrections import background, factors_checksum, read_factors
    from mlemlib.norm import row_weights
    from mlemlib.subsets import check_count, labels_checksum, labels_for

    subsets = check_count(model.subsets)
    m = int(src.shape[0])
    m_user = m if row_fold is None else row_fold.m_user
    given = {"multiplicative": model.multiplicative, "additive": model.additive}
    factors = {k: None if v is None else read_factors(v, m_user, k) for k, v in given.items()}
    names = {k: _spec(v) for k, v in given.items()}
    corr = Corrections(multiplicative=factors_checksum(factors["multiplicative"]),
                       additive=factors_checksum(factors["additive"]),
                       files={"subset_file": _spec(model.subset_file), **names})
    if subsets > 1 or model.subset_file is not None:
        labels, corr.method = labels_for(src, subsets, subset_file=model.subset_file, name=name)
        corr.bounds = _grouped_bounds(labels if perm is None else labels[perm.rows], subsets, corr.method, name)
        corr.subsets, corr.labels = subsets, labels_checksum(labels)
    if factors["multiplicative"] is not None or factors["additive"] is not None:
        mult, add = _to_rows(factors["multiplicative"], factors["additive"], row_fold, perm)
        bg = background(mult, add, m, dtype)
        corr.background = bg if bg.any() else None  # b' = 0 everywhere: g / (fp + 0) is g / fp
    corr.weights = row_weights(src, factors["multiplicative"], perm)
    return corr


def _spec(value: Any) -> str | None:
    """A file argument as text for the record (an array: ``<array>``)."""
    return None if value is None else os.fspath(value) if isinstance(value, (str, os.PathLike)) else "<array>"


def _to_rows(m: np.ndarray | None, b: np.ndarray | None, row_fold: Any,
             perm: Permutation | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Per-LOR ``m`` and ``b`` (the user's order; None: 1 and 0) on the matrix's rows: a folded row's sums
    ``M_r`` and ``B_r`` (:func:`mlemlib.corrections.summed_factors`; ``M_r`` is its multiplicity for m = 1),
    then permuted."""
    from mlemlib.corrections import summed_factors

    if row_fold is not None:
        m, b = summed_factors(row_fold, m, b)
    if perm is None:
        return m, b
    rows = np.asarray(perm.rows)
    return (None if m is None else m[rows]), (None if b is None else b[rows])


def _grouped_bounds(labels: np.ndarray, subsets: int, method: str, name: str) -> np.ndarray:
    """The bounds of ``labels`` in the matrix's row order, which must group them (one line naming the matrix)."""
    from mlemlib.formats import SUFFIXES, container_path, convert_command, file_kind
    from mlemlib.subsets import bounds_of

    files = " --subset-file FILE" if method == "file" else ""
    hint = f"; group them with 'mlem reorder --subsets {subsets}{files}' (the workflow's mlem.subsets does)"
    if any(name.lower().endswith(s) for s in SUFFIXES) and file_kind(name) != "h5":  # reorder reads a container
        hint = (f"; group them in a container: '{convert_command(name)}', then 'mlem reorder {container_path(name)} "
                f"--subsets {subsets}{files} --out OUT.h5' (the workflow's mlem.subsets does)")
    return bounds_of(labels, subsets, name, hint)


def corrected_norm(src: Any, norm: Any, corr: Corrections, dtype: np.dtype) -> np.ndarray:
    """The norm of a run with subsets or ``m``: ``s`` (n values) for S = 1, :func:`mlemlib.subsets.update_norms`
    (S x n, in ``dtype``) for S > 1; from ``norm.h5`` where it holds these subsets' sensitivities for
    these factors (``mlem norm --multiplicative``), else computed here (one pass over the matrix)."""
    from mlemlib.norm import read_norm, read_subset_norms, sensitivities
    from mlemlib.subsets import update_norms

    bounds = corr.bounds if corr.bounds is not None else np.array([0, int(src.shape[0])], dtype=np.int64)
    sk = None
    if norm is not None and not isinstance(norm, (str, os.PathLike)):
        log.warning("a norm given as an array is the column sums of A (S = 1, m = 1): the sensitivities of "
                    "these subsets and factors are computed instead")
    if isinstance(norm, (str, os.PathLike)):
        checksum = getattr(src, "checksum", None)
        read_norm(norm, expected_length=int(src.shape[1]), expected_checksum=str(checksum) if checksum else None)
        sk = read_subset_norms(norm, bounds, corr.multiplicative)
    if sk is None:
        log.info("computing the sensitivities of %d subset(s)%s", len(bounds) - 1,
                 " weighted by m" if corr.multiplicative else "")
        sk = sensitivities(src, bounds, corr.weights)
    return sk[0] if len(bounds) == 2 else update_norms(sk, dtype)


def read_permuted_norm(path: Any, n: int, src: Any, perm: Permutation, matrix_name: str) -> np.ndarray:
    """The ``norm.h5`` of a reordered matrix: it must be that matrix's own norm (in the permuted voxel order).

    The norm of the user's matrix has the same length but the user's voxel
    order; it is recognised by its ``checksum`` attribute (the user's matrix's)
    and refused in one line naming the file, as is any norm of another matrix.
    """
    from mlemlib.norm import read_norm

    expected = getattr(src, "checksum", None) or (getattr(src, "attrs", None) or {}).get("checksum")
    try:
        return read_norm(path, expected_length=n, expected_checksum=str(expected) if expected else None)
    except MatrixFormatError as exc:
        import h5py

        try:
            with h5py.File(path, "r") as f:
                found = plain_attr(f.attrs.get("checksum", ""))
        except OSError:
            raise exc from None
        if found and found == perm.source_checksum:
            raise MatrixFormatError(
                path,
                f"norm of the un-reordered matrix (in the user's voxel order), but {matrix_name} is reordered "
                f"({perm.mode}); use the norm of the reordered matrix ('mlem norm {matrix_name}')",
            ) from None
        raise


def load_truth(truth: Any, n: int) -> tuple[np.ndarray | None, Any]:
    """The truth image (``truth.h5`` or an array of n voxels) and its regions (None where unreadable), or Nones."""
    if truth is None:
        return None, None
    if isinstance(truth, np.ndarray):
        t = truth.reshape(-1)
        if t.size != n:
            raise ConfigError("truth", f"truth has {t.size} voxels, expected n = {n}")
        return t, None
    from mlemlib.phantom import load_regions

    t, attrs = read_image(truth, expected_length=n)
    grid = attrs.get("grid")
    vs = attrs.get("voxel_size")
    try:
        regions = load_regions(attrs, grid, vs)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s: regions attribute unreadable (%s); no contrast recovery", truth, exc)
        regions = None
    return t, regions


def load_reference(reference: Any, n: int, problem: str, iterations: int) -> np.ndarray | None:
    """The reference image (``reference.h5`` of this problem and iteration count, or an array of n voxels), or None."""
    if reference is None:
        return None
    if isinstance(reference, np.ndarray):
        r = reference.reshape(-1)
        if r.size != n:
            raise ConfigError("reference", f"reference has {r.size} voxels, expected n = {n}")
        return r
    r, attrs = read_image(reference, expected_length=n)
    found = attrs.get("problem")
    if found is not None and found != problem:
        raise ConfigError(
            os.fspath(reference), "reference of another problem (matrix or measurement differ); recompute it with --reference-mode"
        )
    it = attrs.get("iterations")
    if it is not None and int(it) != int(iterations):
        raise ConfigError(os.fspath(reference), f"reference after {int(it)} iterations, this run does {iterations}")
    return r


def close_all(objs: list[Any]) -> None:
    """Close every object that has a ``close``; a failing close is logged."""
    for o in objs:
        close = getattr(o, "close", None)
        if callable(close):
            try:
                close()
            except OSError as exc:  # pragma: no cover - a failing close of a read-only file
                log.warning("closing %r: %s", o, exc)
