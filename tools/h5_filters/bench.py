"""Size and write/read speed of the matrix container's datasets under HDF5 filters (docs/formats.md).

    PYTHONPATH=. python3 tools/h5_filters/bench.py OUT_DIR MATRIX.h5 [MATRIX.h5 ...]

For each matrix (any container) and each filter: write its arrays (CSR:
indptr, indices, data; compressed: rowbase, rowoff, codes, values) in 1 MiB
chunks, 2^24 elements per write call, as the writers do; then read them back
whole. Prints one JSON line per (matrix, format, filter): bytes on disk, write
and read seconds and GB/s of the uncompressed arrays. Reads come from the
page cache (the file was just written) unless the script may drop the caches
(root, /proc/sys/vm/drop_caches writable): then they are cold. Blosc filters
need hdf5plugin.
"""

import json
import os
import sys
import time

import h5py
import numpy as np

from mlemlib.compressed import CompressedMatrix
from mlemlib.formats import open_matrix

PIECE = 1 << 24
CHUNK_BYTES = 1 << 20


def filters():
    out = {"none": {}, "lzf": {"compression": "lzf"}, "gzip-1": {"compression": "gzip", "compression_opts": 1},
           "shuffle+gzip-1": {"compression": "gzip", "compression_opts": 1, "shuffle": True}}
    try:
        import hdf5plugin
    except ImportError:
        return out
    out["blosc-lz4"] = dict(hdf5plugin.Blosc(cname="lz4", clevel=5, shuffle=hdf5plugin.Blosc.SHUFFLE))
    out["blosc-zstd-1"] = dict(hdf5plugin.Blosc(cname="zstd", clevel=1, shuffle=hdf5plugin.Blosc.SHUFFLE))
    out["bitshuffle-lz4"] = dict(hdf5plugin.Bitshuffle(cname="lz4"))
    return out


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run(out_dir, name, arrays, fmt):
    raw = sum(a.nbytes for a in arrays.values())
    for label, kw in filters().items():
        path = os.path.join(out_dir, f"{name}-{fmt}-{label}.h5")
        t0 = time.perf_counter()
        with h5py.File(path, "w") as f:
            for key, a in arrays.items():
                chunk = (max(1, min(len(a), CHUNK_BYTES // a.itemsize)),)
                ds = f.create_dataset(key, shape=a.shape, dtype=a.dtype, chunks=chunk, **kw)
                for lo in range(0, len(a), PIECE):
                    ds[lo : lo + PIECE] = a[lo : lo + PIECE]
        os.sync()
        t_write = time.perf_counter() - t0
        cold = drop_caches()
        t0 = time.perf_counter()
        with h5py.File(path, "r") as f:
            for key, a in arrays.items():
                b = np.empty_like(a)
                f[key].read_direct(b)
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
        t_read = time.perf_counter() - t0
        size = os.path.getsize(path)
        print(json.dumps({"matrix": name, "format": fmt, "filter": label, "raw_bytes": raw, "file_bytes": size,
                          "ratio": round(size / raw, 4), "write_s": round(t_write, 3), "read_s": round(t_read, 3),
                          "write_GBps": round(raw / t_write / 1e9, 3), "read_GBps": round(raw / t_read / 1e9, 3),
                          "cold_read": cold}), flush=True)
        os.remove(path)


def main():
    out_dir = sys.argv[1]
    for src in sys.argv[2:]:
        name = os.path.splitext(os.path.basename(src))[0]
        with open_matrix(src) as r:
            a = r.to_csr()
        run(out_dir, name, {"indptr": a.indptr, "indices": a.indices, "data": a.data}, "csr")
        c = CompressedMatrix.from_csr(a)
        run(out_dir, name, {"rowbase": c.rowbase, "rowoff": c.rowoff, "codes": c.codes, "values": c.values},
            "compressed")


if __name__ == "__main__":
    main()
