"""The thesis's published figures, to put beside our runs (data only; no backend).

Source: Mengdi Wang, *Porting MLEM Algorithm for Heterogeneous Systems*,
bachelor's thesis, Technical University of Munich, 2019. Every figure below
cites its table or section; the numbers are copied as printed.

Provides :data:`MATRIX3` (Table 4.3), :data:`V100` (Table 11.4),
:data:`MATRIX3_DGX1` (the one run of section 9.3.9, Table 9.3) and
:func:`runs_for_shape`, which the summary (:mod:`mlemlib.report`) uses to
decide whether a run of ours solved a thesis matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Where the figures come from.
SOURCE = "M. Wang, Porting MLEM Algorithm for Heterogeneous Systems, bachelor's thesis, TU Munich, 2019"


@dataclass(frozen=True)
class ThesisMatrix:
    """A test matrix of the thesis: its name, shape and non-zeros, and the table that gives them."""

    name: str
    rows: int
    cols: int
    nnz: int
    table: str

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


@dataclass(frozen=True)
class ThesisGpu:
    """A GPU of the thesis's platforms: model, theoretical memory bandwidth (bytes/s) and memory (bytes)."""

    model: str
    theoretical_bandwidth: float
    memory: int
    table: str


@dataclass(frozen=True)
class ThesisRun:
    """One published MLEM run: matrix, platform, kernels and the mean time per iteration of each step (s).

    ``steps`` uses our step names (:data:`mlemlib.report.STEPS`): ``fp``,
    ``corr``, ``bp``, ``update``, ``allreduce``. The thesis gives no time of
    the whole iteration; :attr:`iteration_s` is the sum of the steps.
    """

    matrix: ThesisMatrix
    gpu: ThesisGpu
    gpus: int
    platform: str
    fp: str
    bp: str
    iterations: int
    runs: int
    steps: dict[str, float] = field(default_factory=dict)
    #: Effective bandwidths the thesis reports for the run (bytes/s, all GPUs together).
    fp_bandwidth: float | None = None
    bp_bandwidth: float | None = None
    table: str = ""

    @property
    def iteration_s(self) -> float:
        """Seconds per iteration: the sum of the steps of the table."""
        return sum(self.steps.values())

    @property
    def theoretical_bandwidth(self) -> float:
        """The theoretical memory bandwidth of all the run's GPUs together (bytes/s)."""
        return self.gpus * self.gpu.theoretical_bandwidth

    @property
    def label(self) -> str:
        return f"thesis: {self.fp}/{self.bp} x{self.gpus} ({self.platform})"


# Table 4.3 "Matrix 3": rows 5,308,416, columns 2,592,000, NNZs 12,312,716,683 (about 100 GB; artificial data).
MATRIX3 = ThesisMatrix("Matrix 3", 5_308_416, 2_592_000, 12_312_716_683, "Table 4.3")

# Table 11.4 "NVIDIA Tesla V100": memory 16 GB HBM2, bus width 4096 bit, bandwidth 897.0 GB/s.
V100 = ThesisGpu("Tesla V100", 897.0e9, 16 * 10**9, "Table 11.4")

# Section 9.3.9 and Table 9.3 "Performance when Using Large Matrix": Matrix 3 on all eight V100 of the
# DGX-1 (ch. 11.2), run once with 10 MLEM iterations, FP with csr-vector SpMV, BP without the transposed
# matrix (ch. 7). Avg time cost per iteration: BP (no transposed matrix) 2.09212 s, ncclAllReduce
# 1.10013 s, FP (csr-vector) 16.498 ms, Update 49.424 us, Correlation 3.2000 us. Section 9.3.9: effective
# bandwidth 5972.85 GB/s for FP (83.23% of theoretical) and 47.1 GB/s for BP (6.56%); both fractions are
# of 8 x 897.0 GB/s (5972.85 / 7176 = 0.8323, 47.1 / 7176 = 0.00656; section 10.2: "only 6.56% of total
# bandwidth of eight NVIDIA Tesla V100").
MATRIX3_DGX1 = ThesisRun(
    matrix=MATRIX3,
    gpu=V100,
    gpus=8,
    platform="DGX-1",
    fp="csr-vector",
    bp="no transpose",
    iterations=10,
    runs=1,
    steps={"fp": 16.498e-3, "corr": 3.2000e-6, "bp": 2.09212, "update": 49.424e-6, "allreduce": 1.10013},
    fp_bandwidth=5972.85e9,
    bp_bandwidth=47.1e9,
    table="Table 9.3",
)

#: Every published run the summary can put beside ours.
RUNS: tuple[ThesisRun, ...] = (MATRIX3_DGX1,)


def runs_for_shape(shape: tuple[int, int] | list[int] | None) -> list[ThesisRun]:
    """The published runs on a matrix of ``shape`` ``(rows, columns)`` (empty for any other shape)."""
    if shape is None or len(shape) != 2:
        return []
    key = (int(shape[0]), int(shape[1]))
    return [r for r in RUNS if r.matrix.shape == key]
