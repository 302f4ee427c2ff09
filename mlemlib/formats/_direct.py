"""Reads of a container's large datasets straight from the file, on several threads.

h5py serialises every call behind one lock, so one process reads a dataset
on one thread, and a multi-GPU job's shards, each reading its own rows, wait
for each other: 1-2 GB/s from the page cache, where the memory copies of
several threads reach many times that. A dataset whose bytes sit in the file
as they are in memory (no filters, little-endian on a little-endian host,
contiguous or chunked with every chunk written) is read here instead: its
chunks' file offsets are looked up once, a range of elements becomes the
file's byte runs (neighbouring chunks that follow each other in the file
merge), and the runs are read with ``os.preadv`` (which releases the GIL) by
a pool of threads into the caller's array. Any other dataset, and any file
h5py does not open with its default driver, is read by h5py as before
(:meth:`DirectDataset.read` returns False).
"""

from __future__ import annotations

import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

#: Bytes one thread reads per call: large enough that the calls cost nothing, small enough that a
#: piece of a few hundred MB spreads over the pool.
PIECE_BYTES = 16 << 20
#: Threads of the pool every reader shares (a multi-GPU job's shards share it too).
THREADS = max(2, min(16, os.cpu_count() or 2))
#: Reads smaller than this go through h5py (one call, no pool).
MIN_BYTES = 4 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="direct-read")
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there; the child makes its own."""
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


class DirectDataset:
    """File byte offsets of one 1-D dataset, for :meth:`read`; build with :meth:`of` (None if not possible)."""

    def __init__(self, fd: int, itemsize: int, chunk: int, offsets: np.ndarray, size: int) -> None:
        self.fd = fd
        self.itemsize = itemsize
        self.chunk = chunk  # elements per chunk (the dataset's length for a contiguous one)
        self.offsets = offsets  # file offset of each chunk, int64
        self.size = size

    @classmethod
    def of(cls, ds: Any, fd: int) -> DirectDataset | None:
        """The direct reader of h5py dataset ``ds`` through file descriptor ``fd``, or None where h5py must read."""
        try:
            return cls._of(ds, fd)
        except Exception:  # any surprise of the HDF5 layer: h5py reads, as before
            return None

    @classmethod
    def _of(cls, ds: Any, fd: int) -> DirectDataset | None:
        if ds.ndim != 1 or ds.size == 0 or sys.byteorder != "little":
            return None
        if ds.dtype.byteorder not in ("<", "=", "|") or ds.dtype.hasobject or ds.dtype.kind not in "iuf":
            return None
        if ds.file.driver != "sec2" or getattr(ds, "external", None):
            return None
        dcpl = ds.id.get_create_plist()
        if dcpl.get_nfilters() != 0:
            return None
        size, itemsize = int(ds.shape[0]), int(ds.dtype.itemsize)
        if ds.chunks is None:
            off = ds.id.get_offset()
            if off is None:
                return None
            return cls(fd, itemsize, size, np.array([off], dtype=np.int64), size)
        chunk = int(ds.chunks[0])
        count = math.ceil(size / chunk)
        if int(ds.id.get_num_chunks()) != count:
            return None  # chunks never written read as the fill value: h5py knows them
        offsets = np.full(count, -1, dtype=np.int64)
        nbytes = chunk * itemsize
        bad = []

        def visit(info: Any) -> None:
            k = int(info.chunk_offset[0]) // chunk
            if info.filter_mask != 0 or int(info.size) != nbytes or info.byte_offset is None:
                bad.append(k)
            else:
                offsets[k] = int(info.byte_offset)

        if hasattr(ds.id, "chunk_iter"):
            ds.id.chunk_iter(visit)
        else:
            for i in range(count):
                visit(ds.id.get_chunk_info(i))
        if bad or (offsets < 0).any():
            return None
        return cls(fd, itemsize, chunk, offsets, size)

    def runs(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(file offset, byte position in the output, bytes)`` of elements ``[lo, hi)``, neighbours merged."""
        c, isz = self.chunk, self.itemsize
        k0, k1 = lo // c, (hi - 1) // c
        ks = np.arange(k0, k1 + 1, dtype=np.int64)
        start = np.maximum(ks * c, lo)
        stop = np.minimum((ks + 1) * c, hi)
        foff = self.offsets[ks] + (start - ks * c) * isz
        nbytes = (stop - start) * isz
        pos = (start - lo) * isz
        # a run goes on where the next chunk's bytes follow its own in the file
        cont = foff[1:] == foff[:-1] + nbytes[:-1]
        heads = np.flatnonzero(np.concatenate(([True], ~cont)))
        ends = np.append(heads[1:], len(ks))
        out = []
        for h, e in zip(heads.tolist(), ends.tolist()):
            f0, p0, total = int(foff[h]), int(pos[h]), int(nbytes[h:e].sum())
            for a in range(0, total, PIECE_BYTES):
                out.append((f0 + a, p0 + a, min(PIECE_BYTES, total - a)))
        return out

    def read(self, lo: int, hi: int, out: np.ndarray) -> bool:
        """Elements ``[lo, hi)`` into ``out`` (C-contiguous, the dataset's dtype); False if h5py should read."""
        if hi <= lo:
            return True
        if not (0 <= lo < hi <= self.size) or not out.flags.c_contiguous or out.nbytes != (hi - lo) * self.itemsize:
            return False
        if out.nbytes < MIN_BYTES:
            return False
        buf = memoryview(out.reshape(-1).view(np.uint8))
        jobs = [_read_pool().submit(_pread_all, self.fd, buf[p : p + n], f) for f, p, n in self.runs(lo, hi)]
        for j in jobs:
            j.result()
        return True


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``offset`` of ``fd`` (``preadv`` may return fewer bytes than asked)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"read {done} of {len(view)} bytes at offset {offset}: the file ends early")
        done += got
