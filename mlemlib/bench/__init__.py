"""Benchmarks: one runner over named cases, the page generated from its results, and ``mlem bench spmv``.

Modules, one concern each:

- :mod:`~mlemlib.bench.cases` — the cases file (``perf/cases.yaml``): named
  workloads (matrix, LOR order, format, kernel pairs, GPU counts), checked;
- :mod:`~mlemlib.bench.prepare` — a case's matrix made once through the
  library's stages (generate, convert, fold, reorder, transpose) and cached,
  with its rows grouped by OSEM subset and the subsets' sensitivities for S > 1;
- :mod:`~mlemlib.bench.factors` — the problem a row runs: ``g``, the norm,
  and with synthetic factors ``m`` and background ``b`` (cached);
- :mod:`~mlemlib.bench.timing` — iterations timed as the backends report
  them, single calls with CUDA events, the floor of an iteration;
- :mod:`~mlemlib.bench.runner` — every case x kernel pair x GPU count (x S x
  factors) through :func:`mlemlib.backends.make_backend`, into ``results.csv`` /
  ``results.json``;
- :mod:`~mlemlib.bench.page` — ``docs/performance.md`` from results;
- :mod:`~mlemlib.bench.spmv` — the workflow's per-kernel benchmark;
- :mod:`~mlemlib.bench.synthetic` — the synthetic tube-of-response matrix.

Only the public API of the backends is used. Nothing is imported from CuPy
at import; the GPU parts need CuPy and a GPU, the rest runs on the host.
"""

from __future__ import annotations

from mlemlib.bench.spmv import (
    BENCH_OPS,
    BP_BENCH,
    FORMAT_ITERATION_BENCH,
    FP_BENCH,
    ITERATION_BENCH,
    NOTRANS_BENCH,
    bench_spmv,
    check_formats,
    deterministic,
    format_markdown,
    write_results,
)
from mlemlib.bench.synthetic import shuffle_rows, tor_geometry, tor_host, tor_matrix
from mlemlib.devices import copy_bandwidth, record_copy_bandwidths

__all__ = [
    "BENCH_OPS",
    "BP_BENCH",
    "FORMAT_ITERATION_BENCH",
    "FP_BENCH",
    "ITERATION_BENCH",
    "NOTRANS_BENCH",
    "bench_spmv",
    "check_formats",
    "copy_bandwidth",
    "deterministic",
    "format_markdown",
    "record_copy_bandwidths",
    "shuffle_rows",
    "tor_geometry",
    "tor_host",
    "tor_matrix",
    "write_results",
]
