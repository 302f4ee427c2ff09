"""System-matrix generation: trace every tube of response and stream the rows to a file (CPU, Numba).

:func:`generate` traces each line of response once, in chunks of about
``max_nnz`` elements whose row lengths are not known in advance: each
thread appends its rows to an arena, and the chunk's complete rows are
gathered into CSR arrays (:meth:`Tracer.fill_prefix`). Each chunk goes to
the writer of the output, which a helper thread runs while the next chunk is
traced and learns the element count as the rows come: a ``.csr4``
(:class:`mlemlib.formats.csr4.Csr4Writer`) or, for an ``.h5`` output, the
project's container directly, as CSR or compressed
(:class:`~mlemlib.formats.h5.MatrixH5Writer`,
:class:`~mlemlib.formats.compressed_h5.CompressedH5Writer`), so that a big
matrix is never written twice. A folded matrix's stored rows (each LOR once,
``(i, j)`` with ``i < j``, when its tube crosses the grid) are found first by
clipping the tubes' rays to the grid, without walking their voxels. Peak
memory is the arenas and three chunks, and a dense per-thread scratch
vector of the voxel count (8 bytes per voxel and thread).

The output depends only on the :class:`~mlemlib.scanner.geometry.ScannerConfig`,
not on the thread count or chunk size: same configuration, same bytes (and
the same container checksum whichever file is written).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mlemlib.errors import MlemError
from mlemlib.matrix import CSRMatrix
from mlemlib.scanner import _siddon
from mlemlib.scanner.geometry import VOXEL_ORDERS, ScannerConfig, box_bounds, face_points
from mlemlib.scanner.presets import get_preset
from mlemlib.transpose import numba_threads as _numba_threads

log = logging.getLogger(__name__)

#: Default bound on the elements of one streamed chunk (16 Mi elements, 128 MiB).
DEFAULT_MAX_NNZ = 1 << 24


def _resolve(preset: str | ScannerConfig, rays: int | None) -> ScannerConfig:
    if isinstance(preset, ScannerConfig):
        cfg = preset.validate()
        return cfg.with_rays(rays) if rays is not None else cfg
    return get_preset(preset, rays=rays)


class Tracer:
    """Traces rows of one scanner's system matrix with per-thread scratch (CPU, Numba).

    Parameters
    ----------
    cfg
        The scanner; validated here.
    threads
        Number of scratch slots (parallel workers); Numba's current thread
        count by default.
    voxel_order
        ``raster`` (the grid's own: x fastest, then y, then z) or ``hilbert``
        (column ``j'`` is voxel ``voxels[j']`` of the reorder stage's 3-D
        Hilbert order, :func:`mlemlib.reorder.voxel_permutation`; rows sorted
        by the new columns).
    """

    def __init__(self, cfg: ScannerConfig, threads: int | None = None, voxel_order: str = "raster") -> None:
        import numba

        self.cfg = cfg.validate()
        self.n_crystals = cfg.n_crystals
        self.m, self.n = cfg.shape
        self.pts = face_points(cfg)
        lo, _ = box_bounds(cfg)
        self.lo = lo
        self.vs = np.asarray(cfg.voxel_size, dtype=np.float64)
        self.g = np.asarray(cfg.grid, dtype=np.int64)
        self.inv_rays = 1.0 / cfg.rays
        nt = int(threads or numba.get_num_threads())
        self.threads = nt
        # A ray crosses at most gx + gy + gz voxels.
        per_row = min(self.n, cfg.rays * int(self.g.sum()))
        # zero between rows (the kernels clear what a row touched); touched has one spare entry
        self._acc = np.zeros((nt, self.n), dtype=np.float64)
        self._touched = np.zeros((nt, per_row + 1), dtype=np.int32)
        self._sort_tmp = np.zeros((nt, per_row), dtype=np.int32)
        self._hist = np.zeros((nt, (1 << _siddon.RADIX_BITS) + 1), dtype=np.int64)
        self.per_row = per_row
        self._arena: tuple[np.ndarray, np.ndarray] | None = None
        self.voxel_order = check_voxel_order(voxel_order)
        self.voxels: np.ndarray | None = None  # new column -> voxel (None: raster)
        self._lab = self._unlab = np.zeros(0, dtype=np.int32)
        if self.voxel_order == "hilbert":
            from mlemlib.ordering import voxel_permutation

            self.voxels = np.asarray(voxel_permutation(tuple(cfg.grid)), dtype=np.int64)
            self._unlab = self.voxels.astype(np.int32)
            self._lab = np.empty(self.n, dtype=np.int32)
            self._lab[self._unlab] = np.arange(self.n, dtype=np.int32)

    def count(self, rows: np.ndarray) -> np.ndarray:
        """Distinct voxels of each row in ``rows`` (int64 array of row numbers)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        counts = np.zeros(len(rows), dtype=np.int64)
        if len(rows):
            _siddon.count_rows(
                self.pts, self.n_crystals, rows, self.lo, self.vs, self.g,
                self._acc, self._touched, counts,
            )  # fmt: skip
        return counts

    def fill(self, rows: np.ndarray, indptr: np.ndarray) -> CSRMatrix:
        """The rows ``rows`` as a CSR block, given their row pointer from :meth:`count`.

        Raises
        ------
        MlemError
            If a row's count differs from the counting pass (a tracer bug).
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        indptr = np.ascontiguousarray(indptr, dtype=np.int64)
        nnz = int(indptr[-1])
        indices = np.empty(nnz, dtype=np.int32)
        data = np.empty(nnz, dtype=np.float32)
        bad = np.zeros(self.threads, dtype=np.int64)
        if len(rows):
            _siddon.fill_rows(
                self.pts, self.n_crystals, rows, self.lo, self.vs, self.g,
                self._acc, self._touched, self._sort_tmp, self._hist, indptr, self.inv_rays, indices, data, bad,
                self._lab, self._unlab,
            )  # fmt: skip
        if bad.any():
            row = int(bad[bad > 0].min()) - 1
            raise MlemError(f"scanner tracer: row {row} gave a different count in the fill pass (a bug)")
        return CSRMatrix(indptr, indices, data, (len(rows), self.n))

    def hits(self, rows: np.ndarray) -> np.ndarray:
        """1 (int8) where the tube of row ``rows[q]`` crosses the voxel grid, else 0: clipping alone, no voxel walk."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        out = np.zeros(len(rows), dtype=np.int8)
        if len(rows):
            _siddon.rows_hit_box(self.pts, self.n_crystals, rows, self.lo, self.vs, self.g, out)
        return out

    def fill_prefix(self, rows: np.ndarray, max_nnz: int) -> CSRMatrix:
        """Trace ``rows`` once, lengths unknown; return the CSR block of the longest complete prefix.

        Each scratch slot appends its rows to an arena of
        ``max(ceil(max_nnz / threads), longest possible row)`` elements (kept
        for the next call): at most about ``max_nnz`` elements are traced,
        and rows past the first one that did not fit are traced again by the
        caller's next call. The block holds rows ``rows[:k]``, ``k >= 1``
        (every slot's first row fits).
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        nt = self.threads
        cap = max(-(-int(max_nnz) // nt), self.per_row)
        if self._arena is None or self._arena[0].shape[1] != cap:
            self._arena = (np.empty((nt, cap), dtype=np.int32), np.empty((nt, cap), dtype=np.float32))
        a_idx, a_val = self._arena
        counts = np.zeros(len(rows), dtype=np.int64)
        starts = np.zeros(len(rows), dtype=np.int64)
        stop = np.zeros(nt, dtype=np.int64)
        if len(rows):
            _siddon.fill_rows_arena(
                self.pts, self.n_crystals, rows, self.lo, self.vs, self.g, self._acc, self._touched,
                self._sort_tmp, self._hist, self.inv_rays, a_idx, a_val, counts, starts, stop, self._lab, self._unlab,
            )  # fmt: skip
        k = int(stop.min()) if len(rows) else 0
        indptr = np.zeros(k + 1, dtype=np.int64)
        np.cumsum(counts[:k], out=indptr[1:])
        nnz = int(indptr[-1])
        indices = np.empty(nnz, dtype=np.int32)
        data = np.empty(nnz, dtype=np.float32)
        if k:
            _siddon.gather_rows(a_idx, a_val, starts, indptr, indices, data)
        return CSRMatrix(indptr, indices, data, (k, self.n))

    def rows(self, rows: np.ndarray) -> CSRMatrix:
        """Trace ``rows`` (count, then fill) and return them as a CSR block."""
        counts = self.count(rows)
        indptr = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        return self.fill(rows, indptr)


def trace_rows(
    preset: str | ScannerConfig, rows, *, rays: int | None = None, threads: int | None = None
) -> CSRMatrix:
    """Trace chosen rows of the system matrix in memory (tests, inspection, estimates).

    Parameters
    ----------
    preset
        A preset name or a :class:`ScannerConfig`.
    rows
        Row numbers (``i * n_crystals + j``), any order, repeats allowed.
    rays
        Override of the rays per tube.
    threads
        Numba threads.

    Returns
    -------
    CSRMatrix
        ``len(rows) x n_voxels``, columns sorted within each row.
    """
    cfg = _resolve(preset, rays)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if len(rows) and (rows.min() < 0 or rows.max() >= cfg.n_lors):
        from mlemlib.errors import ConfigError

        raise ConfigError("rows", f"row numbers must lie in [0, {cfg.n_lors})")
    with _numba_threads(threads):
        return Tracer(cfg).rows(rows)


class _Progress:
    """Logs ``done/total`` with rate and ETA, at most every ``every`` seconds."""

    def __init__(self, what: str, total: int, unit: str, every: float = 5.0) -> None:
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.t0 = self.last = time.perf_counter()

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.every:
            return
        self.last = now
        dt = now - self.t0
        rate = done / dt if dt > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else math.inf
        pct = 100.0 * done / self.total if self.total else 100.0
        log.info(
            "%s: %d/%d %s (%.1f%%), %.1f s, ETA %.0f s%s",
            self.what, done, self.total, self.unit, pct, dt, eta, extra,
        )  # fmt: skip


def _upper_rows(n_crystals: int, i0: int, i1: int) -> np.ndarray:
    """Rows ``i * N + j`` with ``i0 <= i < i1`` and ``j > i``, ascending."""
    parts = [np.arange(i * n_crystals + i + 1, (i + 1) * n_crystals, dtype=np.int64) for i in range(i0, i1)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def check_voxel_order(order: str) -> str:
    """``order`` if it is one of :data:`VOXEL_ORDERS`, else :class:`ConfigError`."""
    from mlemlib.errors import ConfigError

    if order not in VOXEL_ORDERS:
        raise ConfigError("voxel_order", f"unknown voxel order {order!r}, expected one of {', '.join(VOXEL_ORDERS)}")
    return order


def _attach_voxel_order(writer, tracer: Tracer, m_out: int, nnz: int, preset: str) -> None:
    """Store the generator's voxel labels as the container's permutation (rows unmoved; mlemlib.reorder).

    The container then reads as a reordered one (``mlemlib.reorder.permutation_of``): runs take the
    measurement in the user's LOR order and write images in the grid's raster order.
    """
    from mlemlib.permutation import Permutation, attach

    perm = Permutation(np.arange(m_out, dtype=np.int64), tracer.voxels, "rows+voxels", (m_out, tracer.n), nnz, "")
    attach(writer, perm, f"mlem generate --preset {preset} --voxel-order {tracer.voxel_order}")


def _writer_for(out: Path, fmt: str, cfg: ScannerConfig):
    """A factory ``(m, n, nnz) -> writer`` for ``out``: ``.csr4``, or the container in format ``fmt``."""
    from mlemlib.errors import ConfigError
    from mlemlib.formats import file_kind, matrix_format_of

    kind = file_kind(out)
    spec = matrix_format_of(fmt)  # ConfigError for an unknown format
    if kind == "csr4":
        if spec.compressed:
            raise ConfigError("format", f"a .csr4 file holds CSR; write {fmt} into an .h5 container")
        from mlemlib.formats.csr4 import Csr4Writer

        return lambda m, n, nnz: Csr4Writer(out, m, n, nnz, scanner_block=cfg.scanner_block(), flags=0)
    if kind != "h5":
        raise ConfigError("out", f"{out}: generate writes a .csr4 or an .h5 container, not a .{kind} file")
    attrs = {
        "source": f"mlem generate --preset {cfg.name}",
        "grid": cfg.grid,
        "voxel_size": cfg.voxel_size,
        "scanner_block": cfg.scanner_block(),
        "kind": "matrix",
        "csr4_flags": np.int64(0),
        "preset": cfg.name,
        "rays": np.int64(cfg.rays),
    }
    return lambda m, n, nnz: _Validated(spec.writer(out, (m, n), nnz, **attrs))


class _Validated:
    """A container writer fed blocks the tracer made (sorted, in range, finite): not validated again."""

    def __init__(self, writer) -> None:
        self.writer = writer

    @property
    def checksum(self) -> str:
        return self.writer.checksum

    def write_rows(self, block: CSRMatrix) -> None:
        self.writer.write_rows(block, validate=False)

    @property
    def encodes(self) -> bool:
        """Whether the format encodes blocks (then :meth:`encode_rows` and :meth:`append` split :meth:`write_rows`)."""
        return hasattr(self.writer, "encode_rows")

    def encode_rows(self, block: CSRMatrix, row0: int):
        """The encoded block and the matrix its file will hold (16-bit values decoded), on the caller's threads."""
        enc = self.writer.encode_rows(block, row0=row0)
        return enc, self.writer.decoded(enc, block)

    def append(self, encoded, block: CSRMatrix) -> None:
        enc, decoded = encoded
        self.writer.append_encoded_rows(enc, block, decoded)

    def attach(self, datasets, attrs) -> None:
        self.writer.attach(datasets, attrs)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.writer.__exit__(*exc)


def generate(
    preset: str | ScannerConfig,
    out: str | os.PathLike,
    *,
    rays: int | None = None,
    threads: int | None = None,
    max_nnz: int = DEFAULT_MAX_NNZ,
    fmt: str = "csr",
    fold: bool = False,
    voxel_order: str = "raster",
) -> dict:
    """Generate a scanner's system matrix and write it, with its scanner block, as ``.csr4`` or container.

    Parameters
    ----------
    preset
        ``"small"``, ``"madpet2"``, ``"matrix3"`` or a :class:`ScannerConfig`.
    out
        Target path (written atomically): ``.csr4``, or ``.h5`` for the
        project's container (``matrix.h5``, the same file ``mlem convert``
        makes from the ``.csr4``: same arrays, same checksum).
    rays
        Override of the rays per tube (``k**4``).
    threads
        Numba threads (default: Numba's default, all cores).
    max_nnz
        Bound on the elements traced and written per chunk (memory bound).
    fmt
        Matrix format of an ``.h5`` output: ``csr``, ``compressed``,
        ``compressed-f16`` or ``compressed-u16`` (see ``docs/formats.md``); a
        ``.csr4`` is CSR.
    fold
        Store each line of response once (row ``(i, j)``, ``i < j``; its
        twin ``(j, i)`` and the empty rows are mapped to it by the container's
        row fold, :mod:`mlemlib.fold`): half the rows, traced and written once.
        Needs an ``.h5`` output.
    voxel_order
        ``raster`` (the grid's order) or ``hilbert``: the columns are the
        voxels along the reorder stage's 3-D Hilbert curve (each row sorted by
        them), stored as the container's voxel permutation, so that runs read
        and write images in the grid's order (:mod:`mlemlib.reorder`; as a
        matrix reordered ``rows+voxels`` with its rows unmoved). Neighbouring
        voxels then share cache lines, which speeds up the projections. Needs
        an ``.h5`` output.

    Returns
    -------
    dict
        ``path, preset, format, shape, nnz, rays, threads, empty_rows,
        max_row_nnz, stored_rows (of a folded matrix, else m), unfolded_nnz, voxel_order, scan_seconds (finding the tubes that
        cross the grid: the stored rows of a folded matrix; 0 otherwise), fill_seconds, fill_cut_chunks (chunks cut
        where a row did not fit their arenas), fill_trace_seconds (tracing
        inside the fill pass), fill_encode_seconds (encoding the traced chunks
        into a compressed format, on the same thread), fill_write_wait_seconds
        (waiting for the writer thread), close_seconds (the writer closing the file: its last arrays, checksum and
        rename), seconds, nnz_per_second, bytes, checksum`` (the container's,
        None for a ``.csr4``).

    Raises
    ------
    ConfigError
        For an invalid preset, ray count, thread count, output suffix or format.
    """
    cfg = _resolve(preset, rays)
    out = Path(out)
    make_writer = _writer_for(out, fmt, cfg)
    if fold and out.suffix.lower() == ".csr4":
        from mlemlib.errors import ConfigError

        raise ConfigError("fold", f"{out}: a folded matrix needs the .h5 container (a .csr4 has no row map)")
    if check_voxel_order(voxel_order) != "raster" and out.suffix.lower() == ".csr4":
        from mlemlib.errors import ConfigError

        raise ConfigError("voxel_order", f"{out}: voxel order {voxel_order} needs the .h5 container "
                          "(a .csr4 has no voxel permutation)")
    m, n = cfg.shape
    t_start = time.perf_counter()
    with _numba_threads(threads) as nt:
        log.info(
            "generating %s: %d crystals, %d x %d matrix, %d rays per tube, %d threads -> %s",
            cfg.name, cfg.n_crystals, m, n, cfg.rays, nt, out,
        )  # fmt: skip
        # the fill's threads, one scratch slot each (rows are dealt to the slots in turn: as many
        # slots as threads keeps every thread equally busy)
        fill_threads = nt - writer_cores(nt)
        tracer = Tracer(cfg, fill_threads, voxel_order)
        rows_of, row_fold = None, None
        if fold:  # the stored rows: each LOR whose tube crosses the grid once, as row (i, j) with i < j
            from mlemlib.fold import pair_fold

            upper = _upper_rows(cfg.n_crystals, 0, cfg.n_crystals)
            crosses = np.zeros(m, dtype=np.int8)
            crosses[upper] = tracer.hits(upper)
            row_fold, rows_of = pair_fold(cfg.n_crystals, crosses)
            del upper, crosses
        m_out = m if rows_of is None else len(rows_of)
        t_scan = time.perf_counter() - t_start
        if fold:
            log.info("scan: %d of %d tubes cross the grid (the stored rows), %.1f s", m_out, m // 2, t_scan)
        max_rows = max(4096, m_out // 200)
        prog = _Progress("fill pass", m_out, "rows")
        done = 0
        stats = {"max_row": 0, "empty": 0, "cut": 0}
        t_trace = t_encode = t_wait = 0.0
        # Chunk k + 1 is traced once (its lengths unknown: Tracer.fill_prefix) and then encoded
        # (compressed formats) on this thread, with every Numba thread but writer_cores(nt), while
        # chunk k is written and hashed on a helper thread (the checksum's hashing threads hash its
        # element streams): the tracer and the encoder never compete for the cores, and the writer
        # has its own (at most three chunks in memory). A chunk's row count follows the mean row
        # length of the chunk before (FILL_TARGET of max_nnz); a chunk that does not fit its arenas is cut where
        # a row did not fit, and the next chunk starts there. The writer learns nnz as rows come.
        # Leaving the pool's block joins the helper before the writer closes or aborts.
        with (
            make_writer(m_out, n, None) as writer,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="matrix-writer") as pool,
            _numba_threads(fill_threads),
        ):
            pending: deque = deque()
            encodes = getattr(writer, "encodes", False)
            r0, last_mean = 0, 1.0
            while r0 < m_out:
                want = FIRST_CHUNK_ROWS if r0 == 0 else int(FILL_TARGET * max_nnz / max(last_mean, 1.0))
                r1 = min(m_out, r0 + max(1, min(want, max_rows)))
                t0 = time.perf_counter()
                block = tracer.fill_prefix(np.arange(r0, r1, dtype=np.int64) if rows_of is None else rows_of[r0:r1],
                                           max_nnz)  # fmt: skip
                t1 = time.perf_counter()
                lengths = np.diff(block.indptr)
                stats["max_row"] = max(stats["max_row"], int(lengths.max()))
                stats["empty"] += int((lengths == 0).sum())
                stats["cut"] += block.shape[0] < r1 - r0
                encoded = writer.encode_rows(block, r0) if encodes else None
                t2 = time.perf_counter()
                while len(pending) >= 2:
                    pending.popleft().result()
                t_wait += time.perf_counter() - t2
                t_trace += t1 - t0
                t_encode += t2 - t1
                if encodes:
                    pending.append(pool.submit(writer.append, encoded, block))
                else:
                    pending.append(pool.submit(writer.write_rows, block))
                done += block.nnz
                r0 += block.shape[0]
                last_mean = block.nnz / block.shape[0]  # rows nearby have lengths like these
                prog.update(r0, f", {done} elements, {done * 8 / 1e9:.1f} GB of CSR")
                del block, encoded, lengths
            t1 = time.perf_counter()
            while pending:
                pending.popleft().result()
            t_wait += time.perf_counter() - t1
            if row_fold is not None:
                from mlemlib.fold import attach

                attach(writer, row_fold)
            if tracer.voxels is not None:
                _attach_voxel_order(writer, tracer, m_out, done, cfg.name)
            t_close = time.perf_counter()
        t_close = time.perf_counter() - t_close
        prog.update(r0, force=True)
    nnz = done
    if fold:  # a stored row stands for its LOR's two user rows; the others are empty
        empty_rows = int((row_fold.row_map < 0).sum()) + 2 * stats["empty"]
    else:
        empty_rows = stats["empty"]
    seconds = time.perf_counter() - t_start
    summary = {
        "path": str(out),
        "preset": cfg.name,
        "format": "csr4" if out.suffix.lower() == ".csr4" else fmt,
        "shape": [m, n],
        "nnz": nnz,
        "rays": cfg.rays,
        "threads": nt,
        "empty_rows": empty_rows,
        "max_row_nnz": stats["max_row"],
        "stored_rows": m_out,
        "unfolded_nnz": 2 * nnz if fold else nnz,
        "voxel_order": voxel_order,
        "scan_seconds": round(t_scan, 3),
        "fill_seconds": round(seconds - t_scan, 3),
        "fill_cut_chunks": stats["cut"],
        "fill_trace_seconds": round(t_trace, 3),
        "fill_encode_seconds": round(t_encode, 3),
        "fill_write_wait_seconds": round(t_wait, 3),
        "close_seconds": round(t_close, 3),
        "seconds": round(seconds, 3),
        "nnz_per_second": nnz / seconds if seconds > 0 else 0.0,
        "bytes": out.stat().st_size,
        "checksum": getattr(writer, "checksum", None),
    }
    log.info(
        "wrote %s: %d x %d%s, nnz %d, %.1f s (%.3g nnz/s)", out, m_out, n,
        f" (folded: each of the {m} LORs' rows once)" if fold else "", nnz, seconds, summary["nnz_per_second"],
    )
    return summary


#: Rows of the fill pass's first chunk (the later ones follow the mean row length).
FIRST_CHUNK_ROWS = 1024
#: Share of ``max_nnz`` a fill chunk aims at: the arenas hold ``max_nnz``, and a chunk whose rows do not fit
#: is cut (its rows after the cut are traced again with the next chunk).
FILL_TARGET = 0.85
#: Cores the fill pass leaves to the writer's threads (the writer and the threads hashing its checksum) on
#: machines of at least WRITER_CORES_FROM cores: a tracer on every core starves the writer and then waits for
#: it, while the writer, its checksum hashed in pieces on several threads, needs about one core.
WRITER_CORES = 1
WRITER_CORES_FROM = 8


def writer_cores(threads: int) -> int:
    """Numba threads :func:`generate`'s fill pass leaves to its writer's threads, of ``threads``."""
    return WRITER_CORES if threads >= WRITER_CORES_FROM else 0


def _sample_write_seconds(cfg: ScannerConfig, block: CSRMatrix, fmt: str) -> tuple[float, float]:
    """Seconds :func:`generate` spends encoding ``block`` in format ``fmt`` (0 for CSR; on the current Numba
    threads) and its writer appending it (checked, hashed and written to a temporary file, deleted)."""
    import tempfile

    def write(path: Path, rows: CSRMatrix) -> tuple[float, float]:
        with _writer_for(path, fmt, cfg)(rows.shape[0], rows.shape[1], rows.nnz) as w:
            t0 = time.perf_counter()
            if not w.encodes:
                w.write_rows(rows)
                return 0.0, time.perf_counter() - t0
            enc = w.encode_rows(rows, 0)
            t1 = time.perf_counter()
            w.append(enc, rows)
            return t1 - t0, time.perf_counter() - t1

    with tempfile.TemporaryDirectory(prefix="mlem-estimate-") as d:
        k = min(8, block.shape[0])
        write(Path(d) / "warm.h5", CSRMatrix(block.indptr[: k + 1].copy(), block.indices[: block.indptr[k]],
                                             block.data[: block.indptr[k]], (k, block.shape[1])))  # compile first
        return write(Path(d) / "sample.h5", block)


def _coprime_stride(m: int, n_crystals: int, sample: int) -> int:
    stride = max(1, m // max(1, sample))
    while math.gcd(stride, n_crystals) != 1:
        stride += 1
    return stride


#: Core counts :func:`estimate` scales its time to (besides the threads it ran on).
SCALE_THREADS = (1, 2, 4, 8, 16, 32, 64)


def estimate(
    preset: str | ScannerConfig,
    *,
    rays: int | None = None,
    threads: int | None = None,
    sample: int = 20000,
    fmt: str | None = None,
    fold: bool = False,
) -> dict:
    """Estimate nnz, file sizes and generation time from a strided sample of rows, without writing.

    Rows ``0, s, 2s, ...`` (``s`` coprime with the crystal count, so every
    crystal pair pattern is sampled) are counted and filled; totals are
    scaled by ``m / sample``. :func:`generate` traces each row once (its
    scan of a folded matrix's tubes only clips rays: seconds), so the time
    estimate is ``t_fill * m / sample``, writing excluded. ``seconds_by_threads`` scales it linearly to other
    core counts (the tracer is parallel over rows, with no shared state: on
    the 16-core machine of ``docs/scanner.md`` it scaled 8.2x from 1 to 16
    threads); writing runs beside the tracing in a helper thread and adds
    about ``bytes / disk write rate`` where that is the slower part.

    With ``fmt`` (the container format :func:`generate` would write) the
    sampled rows also go through generate's own writer into a temporary
    file (encoded, then checked, hashed and written, then deleted), both
    times scaled by ``m / sample``: the encoding runs on the tracing threads
    and scales with them; the writer's share (``write_seconds_estimate``)
    does not (one writer thread and the threads hashing its checksum,
    :func:`writer_cores` of the cores left to them). ``wall_seconds_by_threads``
    is then the longer of the fill pass's tracing and encoding and the
    writer, per core count.

    With ``fold`` (:func:`generate`'s ``fold``) the stored rows are the
    non-empty half (row ``(j, i)`` equals row ``(i, j)``, the diagonal is
    empty): non-zeros, bytes and the fill pass's times are halved.

    Returns
    -------
    dict
        ``preset, shape, rays, threads, sampled_rows, sample_seconds,
        nnz_estimate, mean_nnz_per_row, mean_nnz_per_nonempty_row,
        empty_row_fraction, max_row_nnz_sampled, seconds_estimate,
        seconds_by_threads`` (threads -> seconds), ``nnz_per_second``,
        ``bytes_estimate`` (``.csr4``: ``8 * (m + nnz)`` plus the header) and
        ``bytes_by_format`` (``csr4``, ``csr``, ``compressed``,
        ``compressed-f16``, ``compressed-u16``: the matrix arrays, the compressed ones from
        encoding the sampled rows); with ``fmt`` also ``format``,
        ``encode_seconds_estimate``, ``write_seconds_estimate`` and ``wall_seconds_by_threads``.
    """
    from mlemlib.compressed import CompressedMatrix
    from mlemlib.formats.spec import ALL_FORMATS

    cfg = _resolve(preset, rays)
    m, n = cfg.shape
    stride = _coprime_stride(m, cfg.n_crystals, sample)
    rows = np.arange(0, m, stride, dtype=np.int64)
    with _numba_threads(threads) as nt:
        tracer = Tracer(cfg, nt)
        tracer.rows(rows[:8])  # compile / load the cached kernels outside the timing
        t0 = time.perf_counter()
        counts = tracer.count(rows)
        t1 = time.perf_counter()
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        block = tracer.fill(rows, indptr)
        t2 = time.perf_counter()
    scale = m / len(rows)
    half = 0.5 if fold else 1.0  # of the rows, non-zeros and fill pass a folded matrix keeps
    nonempty = counts > 0
    m_out = int(round(nonempty.mean() * m * half)) if fold and len(counts) else m
    nnz_est = float(counts.sum()) * scale * half
    sec_est = (t2 - t1) * half * scale
    by_format = {"csr4": 8 * (m + nnz_est), "csr": 8 * nnz_est + 8 * (m_out + 1) + (8 * m if fold else 0)}
    for spec in ALL_FORMATS:
        if not spec.compressed:
            continue
        enc = CompressedMatrix.from_csr(block, spec.name, validate=False)
        per_slot = spec.slot_bytes(8)
        # slots scale like the elements; the row pointer (and row scales) like the rows
        by_format[spec.name] = enc.slots * scale * half * per_slot + spec.row_bytes * m_out + (8 * m if fold else 0)
    res = {
        "preset": cfg.name,
        "shape": [m, n],
        "rays": cfg.rays,
        "threads": nt,
        "sampled_rows": len(rows),
        "fold": bool(fold),
        "stored_rows_estimate": m_out,
        "sample_seconds": round(t2 - t0, 3),
        "nnz_estimate": nnz_est,
        "mean_nnz_per_row": nnz_est / m if m else 0.0,
        "mean_nnz_per_nonempty_row": float(counts[nonempty].mean()) if nonempty.any() else 0.0,
        "empty_row_fraction": float(1.0 - nonempty.mean()) if len(counts) else 0.0,
        "max_row_nnz_sampled": int(counts.max()) if len(counts) else 0,
        "seconds_estimate": sec_est,
        "seconds_by_threads": {str(k): sec_est * nt / k for k in sorted({*SCALE_THREADS, nt})},
        "nnz_per_second": nnz_est / sec_est if sec_est > 0 else 0.0,
        "bytes_estimate": 8 * (m + nnz_est),
        "bytes_by_format": {k: float(v) for k, v in by_format.items()},
    }
    if fmt is not None:
        with _numba_threads(threads):
            encode_s, write_s = (v * scale * half for v in _sample_write_seconds(cfg, block, fmt))
        fill_s = (t2 - t1) * scale * half
        res["format"] = fmt
        res["encode_seconds_estimate"] = encode_s
        res["write_seconds_estimate"] = write_s
        res["wall_seconds_by_threads"] = {
            str(k): max((fill_s + encode_s) * nt / (k - writer_cores(k)), write_s)
            for k in sorted({*SCALE_THREADS, nt})
        }
        log.info("writing %s: ~ %.0f s for the writer (any core count); ~ %.0f s in all on 32 cores", fmt, write_s,
                 res["wall_seconds_by_threads"]["32"])
    log.info(
        "estimate for %s (%d rays, %d threads, %d sampled rows): nnz ~ %.4g, %.1f GB as CSR, %.1f GB compressed, "
        "~ %.0f s of tracing here, ~ %.0f s on 32 cores (writing excluded)",
        cfg.name, cfg.rays, nt, len(rows), nnz_est, by_format["csr"] / 1e9, by_format["compressed"] / 1e9,
        sec_est, sec_est * nt / 32,
    )  # fmt: skip
    return res
