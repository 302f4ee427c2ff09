"""The CPU backend of the MLEM loop (host memory; NumPy, SciPy and Numba).

Kernels
-------
Forward projection ``fp = A f`` (``fp=``):

- ``numba``: row-parallel CSR SpMV (``prange`` over rows; each row summed in
  order by one thread, so the result does not depend on the thread count);
- ``scipy``: ``scipy.sparse`` CSR times vector (one thread).

``auto`` is ``numba`` with several Numba threads and ``scipy`` with one:
both sum each row in order, so the choice never changes a bit of the result.

Back projection ``bp = A^T c`` (``bp=``), with a stored transpose (a CSR
matrix of ``A^T``) the same SpMV kernels on ``A^T`` (``auto`` as above);
without one (``auto`` is ``numba``):

- ``numba`` (or ``notrans``, which ignores a stored transpose): a scatter
  over the rows of ``A`` in a fixed number of row blocks (``blocks``), each
  into a private image, summed block after block: deterministic for a given
  ``blocks`` whatever the thread count, no atomics;
- ``scipy``: ``A.T @ c`` (SciPy's CSC product of the same arrays, one thread,
  summing each voxel in row order, i.e. the same sums as a sorted transpose).

Accumulation follows the working dtype: float32 (the default, like the GPU
backends) or float64 (the reference mode; float32 matrix values are widened
exactly, so no float64 copy of the matrix is needed by the ``numba`` kernels;
``scipy`` makes one). Every kernel is deterministic.

Numba's OpenMP threads spin while waiting; on a host whose cores are busy
with other work that can make a 2-thread SpMV ten times slower than one
thread. The backend (and :func:`mlemlib.phantom.forward_project`) therefore
set ``OMP_WAIT_POLICY=passive`` unless it is set, which takes effect when it
happens before the process's first parallel Numba launch
(:func:`passive_omp_wait`).
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib import registry
from mlemlib.backends.base import FIXED_RETRIES, FIXED_RETRY_FACTOR, ONEPASS_C_MAX, Backend, bytes_per_nnz
from mlemlib.errors import ConfigError
from mlemlib.formats.spec import CSR, MatrixFormat, matrix_format_of
from mlemlib.matrix import CSRMatrix

log = logging.getLogger(__name__)

#: Default number of row blocks of the no-transpose back projection.
DEFAULT_BLOCKS = 16
#: Row blocks of the float64 reference's no-transpose back projection: a block is one thread's work, and
#: the reference runs on every core of a node (up to 64 at once), where 16 blocks would leave most idle.
REFERENCE_BLOCKS = 64
#: Most bytes of the reference's private images (``blocks x n`` float64); fewer blocks where n needs it.
REFERENCE_PARTIAL_BYTES = 1 << 32


def default_blocks(dtype: Any, n: int) -> int:
    """Row blocks of the no-transpose back projection: :data:`DEFAULT_BLOCKS` in float32 (a run's sums, the
    same since the first version), :data:`REFERENCE_BLOCKS` in float64 where their private images fit
    :data:`REFERENCE_PARTIAL_BYTES`, else as many as fit (at least 16). It depends on the dtype and the image
    size alone, so a problem's sums are the same whatever the machine and its thread count."""
    if np.dtype(dtype) != np.float64:
        return DEFAULT_BLOCKS
    fit = REFERENCE_PARTIAL_BYTES // (8 * max(1, int(n)))
    return int(max(DEFAULT_BLOCKS, min(REFERENCE_BLOCKS, fit)))


# --------------------------------------------------------------------------- Numba kernels
# One function per accumulation dtype (float32, float64): explicit, so that the
# on-disk cache can never hand a float32 kernel a float64 accumulator.
@njit(parallel=True, cache=True, nogil=True)
def _spmv32(indptr, indices, data, x, y):  # pragma: no cover - compiled
    base = indptr[0]
    for i in prange(y.shape[0]):
        s = np.float32(0.0)
        for k in range(indptr[i] - base, indptr[i + 1] - base):
            s += np.float32(data[k]) * np.float32(x[indices[k]])
        y[i] = s


@njit(parallel=True, cache=True, nogil=True)
def _spmv64(indptr, indices, data, x, y):  # pragma: no cover - compiled
    base = indptr[0]
    for i in prange(y.shape[0]):
        s = np.float64(0.0)
        for k in range(indptr[i] - base, indptr[i + 1] - base):
            s += np.float64(data[k]) * np.float64(x[indices[k]])
        y[i] = s


@njit(parallel=True, cache=True, nogil=True)
def _spmv_t32(indptr, indices, data, c, out, partial):  # pragma: no cover - compiled
    nb = partial.shape[0]
    m = c.shape[0]
    n = out.shape[0]
    base = indptr[0]
    for b in prange(nb):
        r0 = b * m // nb
        r1 = (b + 1) * m // nb
        p = partial[b]
        for j in range(n):
            p[j] = np.float32(0.0)
        for i in range(r0, r1):
            ci = np.float32(c[i])
            if ci != 0:
                for k in range(indptr[i] - base, indptr[i + 1] - base):
                    p[indices[k]] += np.float32(data[k]) * ci
    for j in prange(n):
        s = np.float32(0.0)
        for b in range(nb):
            s += partial[b, j]
        out[j] = s


@njit(parallel=True, cache=True, nogil=True)
def _spmv_t64(indptr, indices, data, c, out, partial):  # pragma: no cover - compiled
    nb = partial.shape[0]
    m = c.shape[0]
    n = out.shape[0]
    base = indptr[0]
    for b in prange(nb):
        r0 = b * m // nb
        r1 = (b + 1) * m // nb
        p = partial[b]
        for j in range(n):
            p[j] = np.float64(0.0)
        for i in range(r0, r1):
            ci = np.float64(c[i])
            if ci != 0:
                for k in range(indptr[i] - base, indptr[i + 1] - base):
                    p[indices[k]] += np.float64(data[k]) * ci
    for j in prange(n):
        s = np.float64(0.0)
        for b in range(nb):
            s += partial[b, j]
        out[j] = s


def spmv(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``y[:] = A @ x`` for CSR arrays, row-parallel, accumulating in ``y``'s dtype (float32 or float64).

    ``x`` is converted to ``y``'s dtype if needed; ``indptr`` may start at a
    non-zero offset (a row block). Returns ``y``.
    """
    if y.dtype == np.float64:
        _spmv64(indptr, indices, data, np.ascontiguousarray(x, dtype=np.float64), y)
    elif y.dtype == np.float32:
        _spmv32(indptr, indices, data, np.ascontiguousarray(x, dtype=np.float32), y)
    else:
        raise TypeError(f"spmv: output dtype must be float32 or float64, got {y.dtype}")
    return y


def spmv_t(
    indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, c: np.ndarray, out: np.ndarray, partial: np.ndarray
) -> np.ndarray:
    """``out[:] = A.T @ c`` from the CSR arrays of ``A``, by blocked scatter (no atomics, deterministic).

    ``partial`` is a scratch array of shape ``(blocks, n)`` in ``out``'s dtype.
    Returns ``out``.
    """
    if out.dtype == np.float64:
        _spmv_t64(indptr, indices, data, np.ascontiguousarray(c, dtype=np.float64), out, partial)
    elif out.dtype == np.float32:
        _spmv_t32(indptr, indices, data, np.ascontiguousarray(c, dtype=np.float32), out, partial)
    else:
        raise TypeError(f"spmv_t: output dtype must be float32 or float64, got {out.dtype}")
    return out


@njit(cache=True, nogil=True)
def _update_flush(f, bp, norm, tiny):  # pragma: no cover - compiled
    for j in range(f.shape[0]):
        v = f[j] * bp[j] / norm[j]
        if abs(v) < tiny:  # subnormal (or 0): 0; NaN is kept
            v = 0
        f[j] = v


@njit(cache=True, nogil=True)
def _update_keep(f, bp, norm, tiny):  # pragma: no cover - compiled
    for j in range(f.shape[0]):
        if norm[j] != norm[j]:  # NaN: s^k_j == 0 < s_j, the voxel is kept in this sub-iteration
            continue
        v = f[j] * bp[j] / norm[j]
        if abs(v) < tiny:
            v = 0
        f[j] = v


def update_keep(f: np.ndarray, bp: np.ndarray, norm: np.ndarray) -> np.ndarray:
    """:func:`update_flush` of one OSEM sub-iteration: ``f_j`` kept where ``norm_j`` is NaN
    (:func:`mlemlib.subsets.update_norms`), the same roundings and flush elsewhere. Returns ``f``."""
    if not (f.dtype == bp.dtype == norm.dtype) or f.dtype not in (np.float32, np.float64):
        raise TypeError(f"update_keep: f, bp and norm must share float32 or float64, got {f.dtype}, {bp.dtype}, {norm.dtype}")
    _update_keep(f, bp, norm, f.dtype.type(np.finfo(f.dtype).tiny))
    return f


def correlate(g: np.ndarray, fp: np.ndarray, c: np.ndarray, background: np.ndarray | None = None) -> np.ndarray:
    """``c = g / fp`` (``g / (fp + b')`` with a background ``b'``), 0 where the denominator is 0, in ``c``'s dtype.

    ``b' = +inf`` (a gap) gives 0. Without a background the roundings are those of the thesis's MLEM.
    """
    c[:] = 0
    if background is None:
        np.divide(g, fp, out=c, where=fp != 0)
    else:
        d = fp + background.astype(c.dtype, copy=False)
        np.divide(g, d, out=c, where=d != 0)
    return c


def update_flush(f: np.ndarray, bp: np.ndarray, norm: np.ndarray) -> np.ndarray:
    """``f[:] = f * bp / norm`` in ``f``'s dtype (float32 or float64), values below its smallest normal set to 0.

    The same roundings as ``np.multiply`` then ``np.divide`` in that dtype, in
    one pass. A voxel that MLEM drives towards 0 would otherwise pass through
    the subnormal range, where every product with it in the next projections
    takes the CPU's slow path (tens of times slower per operation): the flush
    changes such a voxel by less than ``np.finfo(dtype).tiny`` (1.2e-38 in
    float32, 2.2e-308 in float64) and keeps the loop at full speed. ``norm``
    must be free of zeros (the backend divides by 1 there). Returns ``f``.
    """
    if not (f.dtype == bp.dtype == norm.dtype) or f.dtype not in (np.float32, np.float64):
        raise TypeError(f"update_flush: f, bp and norm must share float32 or float64, got {f.dtype}, {bp.dtype}, {norm.dtype}")
    _update_flush(f, bp, norm, f.dtype.type(np.finfo(f.dtype).tiny))
    return f


# --------------------------------------------------------------------------- helpers
def passive_omp_wait() -> None:
    """Let idle OpenMP threads sleep instead of spin (``OMP_WAIT_POLICY=passive``) unless the user chose.

    Takes effect only before Numba's first parallel launch in the process
    (when its OpenMP runtime loads). On a host whose cores are shared with
    other work, spinning waiters make a 2-thread SpMV up to ten times slower
    than one thread; sleeping waiters cost microseconds per launch.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")


def _load_csr(matrix: Any, what: str) -> CSRMatrix:
    """The whole matrix as a CSRMatrix (a reader's ``read_rows(0, m)``, or the CSRMatrix itself)."""
    if isinstance(matrix, CSRMatrix):
        return matrix
    if hasattr(matrix, "read_rows"):
        m = int(matrix.shape[0])
        log.info("loading %s (%d x %d, %d nnz) into host memory", what, m, int(matrix.shape[1]), int(matrix.nnz))
        return matrix.read_rows(0, m)
    if hasattr(matrix, "tocsr"):
        return CSRMatrix.from_scipy(matrix)
    raise TypeError(f"{what}: expected a CSRMatrix or an opened matrix, got {type(matrix).__name__}")


def _load(matrix: Any, what: str, fmt: str) -> Any:
    """The whole matrix in host memory: a CSRMatrix (``fmt`` csr), else a CompressedMatrix of ``fmt``.

    A compressed container or matrix is taken as it is encoded (``read_encoded``);
    a CSR source asked for in a compressed format (a stored transpose) is encoded here.
    """
    if not matrix_format_of(fmt).compressed:
        return _load_csr(matrix, what)
    from mlemlib.compressed import CompressedMatrix

    if isinstance(matrix, CompressedMatrix):
        return matrix
    if hasattr(matrix, "read_encoded"):
        return matrix.read_encoded(0, int(matrix.shape[0]))
    return CompressedMatrix.from_csr(_load_csr(matrix, what), fmt, validate=False)


def cmpcpu():
    """The Numba kernels of the compressed format and the one-pass step (:mod:`mlemlib.backends._compressed_cpu`)."""
    from mlemlib.backends import _compressed_cpu

    return _compressed_cpu


def cpu_facts() -> dict[str, Any]:
    """Name and core count of the host CPU (for ``timings.json``)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"kind": "cpu", "name": name, "cores": os.cpu_count()}


# --------------------------------------------------------------------------- the registry's launchers
# One function per CPU kernel (mlemlib.registry binds them with kernel=): projections take
# (be, x, out), whole-iteration steps (be, f) and leave bp and fp in be._bp, be._fp.
def numba_forward(be: CpuBackend, f: np.ndarray, out: np.ndarray, *, kernel: str) -> np.ndarray:
    """``out = A f``: row-parallel Numba SpMV (a compressed matrix's rows decoded on the fly)."""
    if be.matrix_format.compressed:
        return cmpcpu().spmv(be.a, f, out)
    a = be.a
    spmv(a.indptr, a.indices, a.data, f, out)
    return out


def scipy_forward(be: CpuBackend, f: np.ndarray, out: np.ndarray, *, kernel: str) -> np.ndarray:
    """``out = A f`` by SciPy's CSR product."""
    out[:] = be.scipy_matrix("a") @ f
    return out


def numba_back(be: CpuBackend, c: np.ndarray, out: np.ndarray, *, kernel: str) -> np.ndarray:
    """``out = A^T c``: Numba SpMV on the stored transpose, else the blocked scatter from the rows of A."""
    if be.matrix_format.compressed:
        if be.use_transpose:
            return cmpcpu().spmv(be.at, c, out)
        return cmpcpu().spmv_t(be.a, c, out, blocks=be.blocks, partial=be._partial)
    if be.use_transpose:
        at = be.at
        spmv(at.indptr, at.indices, at.data, c, out)
    else:
        a = be.a
        spmv_t(a.indptr, a.indices, a.data, c, out, be._partial)
    return out


def scipy_back(be: CpuBackend, c: np.ndarray, out: np.ndarray, *, kernel: str) -> np.ndarray:
    """``out = A^T c`` by SciPy: its product on the stored transpose, else its CSC product of A."""
    out[:] = be.scipy_matrix("at") @ c if be.use_transpose else be.scipy_matrix("a").T @ c
    return out


def onepass_step(be: CpuBackend, f: np.ndarray, *, kernel: str) -> None:
    """One pass over A: per row its dot product, the ratio (with the background ``b'`` where given) and its
    scatter into per-block images."""
    if not be.matrix_format.compressed:
        a = be.a
        cmpcpu().csr_onepass(a.indptr, a.indices, a.data, be.g, f, bp=be._bp, fp=be._fp, blocks=be.blocks,
                             partial=be._partial, background=be.background)
    else:
        cmpcpu().onepass(be.a, be.g, f, bp=be._bp, fp=be._fp, blocks=be.blocks, partial=be._partial,
                         background=be.background)


def chunked_step(be: CpuBackend, f: np.ndarray, *, kernel: str) -> None:
    """The GPU's ``onepass_chunked`` arithmetic through the same row chunks: fixed point, redone with a range
    2^20 larger on overflow (as the GPU)."""
    from mlemlib import chunked
    from mlemlib.backends._compressed_cuda import chunk_scale

    for attempt in range(FIXED_RETRIES + 1):
        scale = chunk_scale(be._fixed_bound)
        bp, fp, overflow = chunked.onepass_fixed(be._plan, be.a.indptr, be.a.data, be.g, f, scale)
        if not overflow:
            break
        if attempt == FIXED_RETRIES:
            raise ConfigError("bp", f"onepass_chunked: fixed-point overflow after {FIXED_RETRIES} larger ranges")
        be._fixed_bound *= FIXED_RETRY_FACTOR
        be.fixed_stats["retries"] = be.fixed_stats.get("retries", 0) + 1
    be.fixed_stats.update(scale=scale, bound=be._fixed_bound)
    be._bp[:] = bp
    be._fp[:] = fp


# --------------------------------------------------------------------------- subsets
def _rows(a: Any, r0: int, r1: int) -> Any:
    """Rows ``[r0, r1)`` of a host matrix (CSR or compressed) as views of its arrays."""
    from mlemlib.matrix import slice_rows

    return slice_rows(a, r0, r1) if isinstance(a, CSRMatrix) else a.row_range(r0, r1)


def _columns(at: Any, r0: int, r1: int, fmt: str) -> Any:
    """Columns ``[r0, r1)`` of a stored transpose (one subset's LORs), each row in its stored order, in the
    transpose's own format (``fmt`` for a CSR one): a lossy matrix's transpose is stored exact, and encoding
    its columns in 16 bits again would round them a second time.

    A copy (made once at set-up): the back projection of a subset then reads its own
    non-zeros only, summing them in the order the whole transpose would (the others add exact zeros).
    """
    spec = matrix_format_of(getattr(at, "format", None) or fmt)
    import scipy.sparse as sp

    csr = at if isinstance(at, CSRMatrix) else at.to_csr(validate=False)
    part = CSRMatrix.from_scipy(sp.csr_matrix((csr.data, csr.indices, csr.indptr), shape=csr.shape)[:, r0:r1])
    if not spec.compressed:
        return part
    from mlemlib.compressed import CompressedMatrix

    return CompressedMatrix.from_csr(part, spec.name, validate=False)


class _HostRows:
    """What the registry's cpu launchers read of a backend: ``a`` (``at``), ``format`` (and its description,
    ``matrix_format``), ``dtype``, ``g``, ``background``, the buffers, and SciPy views of the matrices
    (:meth:`scipy_matrix`)."""

    a: Any
    at: Any
    matrix_format: MatrixFormat
    dtype: np.dtype
    _scipy: dict[str, Any]

    def scipy_matrix(self, which: str):
        """``A`` (``which="a"``) or ``A^T`` (``"at"``) as a SciPy CSR matrix of the backend's dtype (made on
        first use: views of the arrays, a converted copy of the values for float64)."""
        if which not in self._scipy:
            import scipy.sparse as sp

            a = self.a if which == "a" else self.at
            data = a.data if self.dtype == a.data.dtype else a.data.astype(self.dtype)
            self._scipy[which] = sp.csr_matrix((data, a.indices, a.indptr), shape=a.shape, copy=False)
        return self._scipy[which]


class _Subset(_HostRows):
    """One OSEM subset of a :class:`CpuBackend` as its launchers see it: its rows of ``A`` (views), its columns
    of a stored transpose, its slices of ``g``, ``b'`` and the row buffers, its update norm."""

    def __init__(self, be: CpuBackend, k: int, r0: int, r1: int) -> None:
        self.format, self.matrix_format, self.dtype, self.blocks = be.format, be.matrix_format, be.dtype, be.blocks
        self.use_transpose, self._partial, self._bp = be.use_transpose, be._partial, be._bp
        self.a = _rows(be.a, r0, r1)
        self.at = _columns(be.at, r0, r1, be.format) if be.use_transpose else None
        self.g, self._fp, self._c = be.g[r0:r1], be._fp[r0:r1], be._c[r0:r1]
        self.background = None if be.background is None else be.background[r0:r1]
        self.norm = be._norm_safe[k]
        self.fixed_stats = be.fixed_stats
        self._scipy: dict[str, Any] = {}
        self._plan = None
        if be._kb.chunks:
            from mlemlib import chunked

            self._plan = chunked.build_plan(self.a)
            self._fixed_bound = ONEPASS_C_MAX * float(np.nanmax(self.norm, initial=1.0))


# --------------------------------------------------------------------------- backend
class CpuBackend(_HostRows, Backend):
    """MLEM on the host CPU.

    Parameters
    ----------
    matrix
        ``A`` as a :class:`~mlemlib.matrix.CSRMatrix` or an opened matrix
        (``read_rows``); loaded whole into host memory.
    g
        Measurement, length m (int32 counts or floats).
    norm
        Column sums of ``A``, length n (float64 recommended).
    transpose
        ``A^T`` (shape (n, m)) as CSRMatrix or opened matrix, or None.
    fp, bp
        Kernel names of :mod:`mlemlib.registry` (``auto``: :func:`mlemlib.registry.resolve`).
    dtype
        ``float32`` (default) or ``float64`` (reference mode).
    threads
        Numba threads (``numba.set_num_threads``); None keeps Numba's default.
    blocks
        Row blocks of the no-transpose back projection (None: :func:`default_blocks`).
    background
        ``b' = b / m`` per row (float32, ``+inf`` at a gap), or None (b = 0, m = 1): ``c = g / (fp + b')``.
    subsets
        None (S = 1), or the S + 1 row bounds of the OSEM subsets; ``norm`` is then
        :func:`mlemlib.subsets.update_norms`'s (S, n) and :meth:`iterate` runs the S sub-iterations.
    """

    name = "cpu"
    deterministic = True
    #: The matrix is in host memory: its forward projection serves host-side diagnostics (MAP's objective).
    matrix_on_host = True

    def __init__(
        self,
        matrix: Any,
        g: np.ndarray,
        norm: np.ndarray,
        *,
        transpose: Any | None = None,
        fp: str = "auto",
        bp: str = "auto",
        dtype: Any = np.float32,
        threads: int | None = None,
        blocks: int | None = None,
        background: np.ndarray | None = None,
        subsets: np.ndarray | None = None,
    ) -> None:
        super().__init__()
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ConfigError("dtype", f"the cpu backend computes in float32 or float64, not {self.dtype}")
        passive_omp_wait()
        if threads is not None:
            import numba

            from mlemlib.transpose import usable_threads

            numba.set_num_threads(usable_threads(threads))
        choice = self._resolve_kernels(matrix, transpose, fp, bp)
        if blocks is not None and int(blocks) < 1:
            raise ConfigError("blocks", f"must be >= 1, got {blocks}")
        m, n = self._load_matrices(matrix, transpose, choice)
        self._take_problem(g, norm, background, subsets, m, n)
        self._allocate_buffers(blocks, m, n)
        self._plan_iteration()
        self._warm_up()

    # --- set-up steps, in the constructor's order -----------------------------------
    def _resolve_kernels(self, matrix: Any, transpose: Any | None, fp: str, bp: str) -> Any:
        """The kernels (:func:`mlemlib.registry.decide`) and their launchers; the choice."""
        import numba

        # A compressed matrix runs its own (float32) kernels; the float64 reference reads it decoded.
        self.matrix_format = matrix_format_of(matrix) if self.dtype == np.float32 else CSR
        self.format = self.matrix_format.name
        choice = registry.decide("cpu", fp, bp, transpose_available=transpose is not None,
                                 threads=numba.get_num_threads(), fmt=self.format)
        self.fp_kernel, self.bp_kernel = choice.fp, choice.bp
        self._kb = registry.get_bp("cpu", self.bp_kernel)
        self.onepass = self._kb.op == "iteration"
        self._kf = None if self.onepass else registry.get("cpu", "forward", self.fp_kernel)
        # the forward projection alone (forward()): a one pass's is the row-parallel SpMV
        self._forward = registry.launcher(self._kf or registry.get("cpu", "forward", "numba"))
        self._step = registry.launcher(self._kb)
        # the back projection alone (back()): a one pass's is the blocked scatter from the rows of A
        self._back = registry.launcher(registry.get_bp("cpu", "notrans") if self.onepass else self._kb)
        if self.onepass and self.dtype != np.float32:
            raise ConfigError("bp", f"bp={self.bp_kernel} computes in float32; the float64 reference uses scipy")
        return choice

    def _load_matrices(self, matrix: Any, transpose: Any | None, choice: Any) -> tuple[int, int]:
        """Load ``A``, and ``A^T`` where the back projection reads it, into host memory; ``A``'s shape."""
        self.a = _load(matrix, "matrix", self.format)
        m, n = self.a.shape
        self.shape = (m, n)
        self.use_transpose = transpose is not None and choice.needs_transpose
        self.at = _load(transpose, "transpose", self.format) if self.use_transpose else None
        if self.at is not None and tuple(self.at.shape) != (n, m):
            raise ConfigError("transpose", f"transpose has shape {self.at.shape}, expected (n, m) = {(n, m)}")
        return m, n

    def _take_problem(self, g: np.ndarray, norm: np.ndarray, background: np.ndarray | None,
                      subsets: np.ndarray | None, m: int, n: int) -> None:
        """Check the measurement, norm, background and subsets, and keep them in the backend's dtype."""
        g, norm = self._check_problem(g, norm, (m, n), float32=self.dtype == np.float32)
        self.background = self._check_background(background, m, self.dtype)
        self.bounds = self._check_subsets(subsets, norm, (m, n))
        if self.bounds is not None and len(self.bounds) == 2:  # one subset: MLEM, today's path
            self.bounds, norm = None, norm.reshape(-1)
        if self._kb.chunks and self.background is not None:
            g = self._gaps_as_zero_counts(g)
        self.g = np.ascontiguousarray(g, dtype=self.dtype)
        self.norm = norm.astype(self.dtype)
        # Divide by 1 where norm == 0: the contract's "f * bp" there, exactly.
        self._norm_safe = np.where(self.norm != 0, self.norm, self.dtype.type(1))

    def _allocate_buffers(self, blocks: int | None, m: int, n: int) -> None:
        """The iteration's vectors, and the no-transpose back projection's partial sums per row block."""
        self.blocks = int(blocks) if blocks is not None else default_blocks(self.dtype, n)
        self._fp = np.empty(m, dtype=self.dtype)
        self._c = np.empty(m, dtype=self.dtype)
        self._bp = np.empty(n, dtype=self.dtype)
        self._partial = None
        if not self.use_transpose and self._kb.blocks:
            self._partial = np.empty((self.blocks, n), dtype=self.dtype)

    def _plan_iteration(self) -> None:
        """The chunked one pass's plan of the whole matrix, and the OSEM subsets' row views."""
        self._plan = None
        self.fixed_stats: dict[str, Any] = {}
        if self._kb.chunks:  # the GPU kernel's arithmetic through the same row chunks
            from mlemlib import chunked

            if not isinstance(self.a, CSRMatrix):  # a compressed matrix: its decoded values (as the GPU's), one copy
                self.a = self.a.to_csr(validate=False)
            if self.bounds is None:
                self._plan = chunked.build_plan(self.a)
            self._fixed_bound = ONEPASS_C_MAX * float(np.nanmax(self.norm)) if self.norm.size else 1.0
        self._scipy: dict[str, Any] = {}
        self._subsets = [] if self.bounds is None else [
            _Subset(self, k, int(self.bounds[k]), int(self.bounds[k + 1])) for k in range(len(self.bounds) - 1)
        ]

    # --- set-up helpers --------------------------------------------------------
    def _gaps_as_zero_counts(self, g: np.ndarray) -> np.ndarray:
        """For a kernel without a background term (the chunked one pass): a gap's ``b' = inf`` as a count of 0
        (``0 / fp = g / inf = 0``), and no background left; refused where ``b > 0`` somewhere."""
        gaps = np.isinf(self.background)
        if np.any(self.background[~gaps] != 0):
            raise ConfigError("bp", f"bp={self.bp_kernel} on the cpu takes no additive background (b); "
                                    "use bp=onepass or numba")
        self.background = None
        return np.where(gaps, 0, g).astype(g.dtype)

    def _warm_up(self) -> None:
        """Compile (or load from cache) the Numba kernels now, not in the first timed iteration."""
        ip = np.array([0, 1], dtype=np.int64)
        ix = np.array([0], dtype=np.int32)
        d = np.array([1.0], dtype=np.float32)
        x = np.ones(1, dtype=self.dtype)
        spmv(ip, ix, d, x, np.empty(1, dtype=self.dtype))
        update_flush(x.copy(), x, x)
        if self._partial is not None:
            spmv_t(ip, ix, d, x, np.empty(1, dtype=self.dtype), np.empty((1, 1), dtype=self.dtype))
        update_keep(x.copy(), x, x)
        if self._kb.chunks:
            from mlemlib import chunked

            one = CSRMatrix(ip, ix, d, (1, 1))
            chunked.onepass_fixed(chunked.build_plan(one), ip, d, d, d, 1.0)

    # --- the four steps ----------------------------------------------------------
    def iterate(self, f: np.ndarray) -> np.ndarray:
        if self._subsets:
            return self._iterate_subsets(f)
        if not self.onepass:
            return super().iterate(f)
        self._times = {}
        with self.timer("bp"):  # one pass: forward, correlation and back projection
            self._step(self, f)
        with self.timer("update"):
            f = self.update(f, self._bp)
        return f

    def _iterate_subsets(self, f: np.ndarray) -> np.ndarray:
        """One OSEM iteration: the S sub-iterations in order, each over its subset's rows (its own views)."""
        self._times = {}
        for sub in self._subsets:
            self._sub_iteration(sub, f)
        return f

    def _sub_iteration(self, sub: Any, f: np.ndarray) -> None:
        """One sub-iteration over ``sub``'s rows, ``f`` updated in place."""
        if self.onepass:
            with self.timer("bp"):
                self._step(sub, f)
        else:
            with self.timer("fp"):
                fp = self._forward(sub, f, sub._fp)
            with self.timer("corr"):
                c = correlate(sub.g, fp, sub._c, sub.background)
            with self.timer("bp"):
                self._back(sub, c, sub._bp)
        with self.timer("update"):
            update_keep(f, sub._bp, sub.norm)

    def sub_iterate(self, f: np.ndarray, k: int) -> np.ndarray:
        if not self._subsets:
            return super().sub_iterate(f, k)
        self._times = {}
        self._sub_iteration(self._subsets[k], f)
        return f

    def forward(self, f: np.ndarray) -> np.ndarray:
        return self._forward(self, f, self._fp)

    def correlate(self, fp: np.ndarray) -> np.ndarray:
        return correlate(self.g, fp, self._c, self.background)

    def back(self, c: np.ndarray) -> np.ndarray:
        return self._back(self, c, self._bp)

    def update(self, f: np.ndarray, bp: np.ndarray, subset: int = 0) -> np.ndarray:
        """``f * bp / norm`` in place, a value below the dtype's smallest normal number set to 0 in the same pass
        (:func:`update_flush`); with subsets that of sub-iteration ``subset`` (:func:`update_keep`)."""
        if self._subsets:
            return update_keep(f, bp, self._subsets[subset].norm)
        return update_flush(f, bp, self._norm_safe)

    # --- set-up and transfers ------------------------------------------------------
    def initial_image(self) -> np.ndarray:
        value = self._initial_value()
        return np.full(self.shape[1], value, dtype=self.dtype)

    def to_host(self, f: np.ndarray) -> np.ndarray:
        return np.array(f, dtype=self.dtype, copy=True)

    def from_host(self, f: np.ndarray) -> np.ndarray:
        return self._check_image(f, self.dtype)

    def describe(self) -> dict[str, Any]:
        import numba

        if self._kb.chunks:
            chunks = sum(p._plan.chunks for p in self._subsets) if self._subsets else self._plan.chunks
            bp_path = f"one pass through {chunks} row chunks (the GPU kernel's fixed-point arithmetic)"
        elif self.onepass:
            bp_path = f"one pass over A (blocked scatter, {self.blocks} blocks)"
        elif self.use_transpose:
            bp_path = "stored transpose"
        elif not self._kb.blocks:
            bp_path = "A.T @ c (scipy)"
        else:
            bp_path = f"blocked scatter ({self.blocks} blocks)"
        return {
            "backend": self.name,
            "deterministic": self.deterministic,
            "fp": self.fp_kernel,
            "bp": self.bp_kernel,
            "bp_path": bp_path,
            "format": self.format,
            "bytes_per_nnz": {"A": bytes_per_nnz(self.a), "AT": bytes_per_nnz(self.at)},
            "onepass": self.onepass,
            "fixed_point": dict(self.fixed_stats) if self._kb.chunks else None,
            "subsets": 1 if self.bounds is None else len(self.bounds) - 1,
            "background": self.background is not None,
            "steps": ["bp", "update"] if self.onepass else ["fp", "corr", "bp", "update"],
            "transpose": self.use_transpose,
            "dtype": str(self.dtype),
            "threads": int(numba.get_num_threads()),
            "device": cpu_facts(),
        }
