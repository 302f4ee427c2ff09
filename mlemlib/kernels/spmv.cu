// SpMV kernels of mlemlib's CUDA backend (compiled at run time by cupy.RawModule).
//
// Storage (see docs/gpu.md): CSR with a 64-bit row pointer (long long), 32-bit
// column indices (int) and float32 values. The 64-bit row pointer is the
// project's canonical one (mlemlib.matrix.CSRMatrix); it costs 8 bytes per row,
// under 1.5% of the matrix for PET rows of a few hundred non-zeros, and keeps
// matrices with 2^31 or more non-zeros on one code path.
//
// Kernels (all extern "C", so cupy.RawModule finds them by name):
//
//   csr_scalar          one thread per row (baseline). Deterministic.
//   csr_vector_L        L = 2, 4, 8, 16, 32 lanes per row; 16-byte loads of
//                       columns and values; warp-shuffle reduction; no atomics.
//                       Deterministic: a row's summation order depends only on
//                       its start, end, L and the matrix's layout (csr_interleave).
//   csr_block_L         csr_vector_L (the same sums) in blocks of up to 1024
//                       threads whose rows advance together (launch shape only).
//                       Both take an optional row list (the last argument, m its
//                       length): the r-th row taken is then rows[r], read in place
//                       and written to y[rows[r]]; rows not listed are not written
//                       (the non-empty rows only: DeviceCSR.compact_rows; every row
//                       in another order: DeviceCSR.set_row_order).
//   csr_row_L           csr_vector_L's sums (L = 8, 16, 32) with one row per group and no loop, in
//                       as few registers as they fit (32 at two 1024-thread blocks per
//                       multiprocessor, -DMLEM_BLOCK_MINB=2): 64 warps of neighbouring rows on a
//                       multiprocessor instead of 32. Same row list as csr_vector_L. Rows of fewer
//                       than 2^31 - 4 non-zeros (32-bit offsets within a row).
//   merge_spmv          merge-path SpMV of the thesis (5.1): each thread takes
//                       `secsize` merge items (a non-zero or a row end) and adds
//                       its partial row sums with atomicAdd. NOT deterministic.
//   scatter_L           back projection without a transpose (thesis ch. 7):
//                       L lanes per row of A, one element per lane per trip,
//                       add a_ij * c_i into out[j] with atomicAdd; launched
//                       without a grid-stride loop, the rows in a spread
//                       order (group w takes row w P mod m). NOT deterministic.
//   scatter_vec_L       the same with 4 elements per lane, adding 2 or 4 contiguous, aligned columns
//                       with one vector atomic (sm_90). NOT deterministic. The
//                       vector atomics are compiled only with
//                       -DMLEM_VECTOR_ATOMICS (a separate build of this file,
//                       so that a compiler without them loses this kernel only;
//                       without the macro scatter_vec_L equals scatter_L).
//   scatter_smem        back projection without a transpose, one block per
//                       nnz-balanced chunk of rows, accumulating into a window
//                       of the output held in shared memory when the chunk's
//                       columns fit, else straight into global memory.
//                       NOT deterministic.
//   chunk_bounds        set-up kernel of scatter_smem: column min/max per chunk.
//   csr_interleave      set-up kernel of DeviceCSR.set_layout: each row's elements reordered
//                       in place for csr_vector's L lanes (below), or put back in column order.
//
// Epilogues (the `mode` argument of csr_scalar / csr_vector_L), which fuse the
// elementwise MLEM steps into the projections:
//   0  y[r] = sum                                         (plain SpMV)
//   1  y[r] = sum != 0 ? aux0[r] / sum : 0                (correlation c = g / fp, aux0 = g)
//   2  y[r] = aux1[r] != 0 ? aux0[r] * sum / aux1[r]      (update f * bp / norm,
//             : aux0[r] * sum                              aux0 = f, may alias y; aux1 = norm;
//                                                          aux1[r] NaN: aux0[r], f kept)
//   3  y[r] = d != 0 ? aux0[r] / d : 0, d = sum + aux1[r] (correlation with a background,
//                                                          aux0 = g, aux1 = b / m)
// (epilogue.cuh has them.)
// The formulas are spelled exactly as in the separate elementwise kernels of
// the backend, so fused and unfused iterations give bit-identical images.

typedef long long i64;

// Trips of group_dot's 16-byte loop unrolled (loads of that many int4/float4 pairs issued together;
// RowShape.unroll, a launch-shape variant). The sums are the same for any value.
#ifndef MLEM_VEC_UNROLL
#define MLEM_VEC_UNROLL 4
#endif

// Loads of the matrix's own arrays (columns, values) in group_dot: through the
// read-only path (__ldg, the default) or as streaming loads that are evicted
// first (-DMLEM_STREAM: __ldcs), which leaves L1 to the gathers of x.
#ifdef MLEM_STREAM
#define LDM(p) __ldcs(p)
#else
#define LDM(p) __ldg(p)
#endif

// Trips of scatter_L whose loads are issued before their atomics.
constexpr int SCATTER_UNROLL = 2;

// Minimum resident blocks of csr_block_L per multiprocessor (-DMLEM_BLOCK_MINB=2
// holds 1024-thread blocks to 32 registers so that two fit).
#ifndef MLEM_BLOCK_MINB
#define MLEM_BLOCK_MINB 1
#endif

#include "epilogue.cuh"  // MODE_*, RowAux, load_aux, write_row

// The r-th row a group takes (rows[r] where a row list is given, else r): its bounds and its
// epilogue's operands, the last loaded by the lane that writes the row (`mine`). The row
// loops below load them one row ahead, so that their latency (rows[r], then rowptr and
// aux0/aux1 at it) overlaps the previous row's dot product instead of stalling the group
// before this row's first gathers.
struct RowHead {
    i64 s, e, ry;
    RowAux pre;
};

__device__ __forceinline__ RowHead load_head(i64 r, i64 m, bool mine, const i64* __restrict__ rowptr,
                                             const i64* __restrict__ rows, int mode, const float* aux0,
                                             const float* aux1) {
    RowHead h{0, 0, r, {0.0f, 0.0f}};
    if (r < m) {
        if (rows != nullptr) h.ry = rows[r];
        h.s = rowptr[h.ry];
        h.e = rowptr[h.ry + 1];
        if (mine) h.pre = load_aux(mode, h.ry, aux0, aux1);
    }
    return h;
}

// ---------------------------------------------------------------------------
// csr_scalar: one thread per row, grid-stride over rows.
extern "C" __global__ void csr_scalar(const i64* __restrict__ rowptr, const int* __restrict__ col,
                                      const float* __restrict__ val, const float* __restrict__ x,
                                      float* y, i64 m, int mode, const float* aux0,
                                      const float* aux1) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < m; r += stride) {
        const i64 s = rowptr[r], e = rowptr[r + 1];
        float sum = 0.0f;
        for (i64 k = s; k < e; ++k) sum += __ldg(val + k) * __ldg(x + __ldg(col + k));
        write_row(mode, r, sum, y, load_aux(mode, r, aux0, aux1));
    }
}

// One 16-byte trip of a lane: four gathers of x at the columns c, then the four products added to sum in
// the order of the elements (every row kernel sums a trip so: the same bits).
__device__ __forceinline__ float quad_dot(float sum, const int4 c, const float4 v, const float* __restrict__ x) {
    const float x0 = __ldg(x + c.x), x1 = __ldg(x + c.y), x2 = __ldg(x + c.z), x3 = __ldg(x + c.w);
    sum += v.x * x0;
    sum += v.y * x1;
    sum += v.z * x2;
    sum += v.w * x3;
    return sum;
}

// ---------------------------------------------------------------------------
// Dot product of row [s, e) with x by the L lanes of one group; each lane
// returns its partial sum. Elements [s, a) (a = s rounded up to a multiple of
// 4) and [4*qe, e) are loaded one by one, the rest as int4/float4 (16 bytes):
// the arrays themselves must be 16-byte aligned (the Python side checks).
template <int L>
__device__ __forceinline__ float group_dot(i64 s, i64 e, const int* __restrict__ col,
                                           const float* __restrict__ val,
                                           const float* __restrict__ x, int lane) {
    float sum = 0.0f;
    const i64 a = (s + 3) & ~(i64)3;
    const i64 head_end = a < e ? a : e;
    for (i64 k = s + lane; k < head_end; k += L) sum += LDM(val + k) * __ldg(x + LDM(col + k));
    const i64 qe = e >> 2;
    const int4* __restrict__ col4 = reinterpret_cast<const int4*>(col);
    const float4* __restrict__ val4 = reinterpret_cast<const float4*>(val);
#pragma unroll MLEM_VEC_UNROLL
    for (i64 q = (a >> 2) + lane; q < qe; q += L) {
        const int4 c = LDM(col4 + q);
        const float4 v = LDM(val4 + q);
        sum = quad_dot(sum, c, v, x);
    }
    const i64 t0 = (qe << 2) > a ? (qe << 2) : a;
    for (i64 k = t0 + lane; k < e; k += L) sum += LDM(val + k) * __ldg(x + LDM(col + k));
    return sum;
}

// csr_vector_L: groups of L lanes, one row per group, grid-stride. The loop
// runs over warp-aligned row bases so every lane of a warp takes the same
// number of trips and the full-mask shuffles are legal.
//
// rows: null (m rows in order), or the m rows to take in that order (DeviceCSR.compact_rows: the
// non-empty ones; DeviceCSR.set_row_order: all of them, A^T's voxels along a Hilbert curve): the r-th
// row taken is rows[r], its sum goes to y[rows[r]] with the epilogue at rows[r]; rows not listed
// are not written.
template <int L>
__device__ __forceinline__ void csr_vector_body(const i64* __restrict__ rowptr,
                                                const int* __restrict__ col,
                                                const float* __restrict__ val,
                                                const float* __restrict__ x, float* y, i64 m,
                                                int mode, const float* aux0, const float* aux1,
                                                const i64* __restrict__ rows) {
    const int lane = threadIdx.x & (L - 1);
    const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 ngroups = ((i64)gridDim.x * blockDim.x) / L;
    i64 r = gtid / L;
    RowHead h = load_head(r, m, lane == 0, rowptr, rows, mode, aux0, aux1);
    for (; r - (threadIdx.x & 31) / L < m; r += ngroups) {
        const RowHead next = load_head(r + ngroups, m, lane == 0, rowptr, rows, mode, aux0, aux1);
        float sum = group_dot<L>(h.s, h.e, col, val, x, lane);
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off, L);
        if (r < m && lane == 0) write_row(mode, h.ry, sum, y, h.pre);
        h = next;
    }
}

#define CSR_VECTOR(L)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 1) csr_vector_##L(                            \
        const i64* __restrict__ rowptr, const int* __restrict__ col,                              \
        const float* __restrict__ val, const float* __restrict__ x, float* y, i64 m, int mode,   \
        const float* aux0, const float* aux1, const i64* rows) {                                  \
        csr_vector_body<L>(rowptr, col, val, x, y, m, mode, aux0, aux1, rows);                   \
    }
CSR_VECTOR(2)
CSR_VECTOR(4)
CSR_VECTOR(8)
CSR_VECTOR(16)
CSR_VECTOR(32)

// csr_block_L: csr_vector_L with the block's rows kept together. A block of
// up to 1024 threads takes blockDim.x / L consecutive rows per trip and every
// thread of the block makes the same trips (the loop runs over block-aligned
// row bases), so with `sync` set a barrier after each trip keeps the block's
// rows in step: neighbouring rows of A^T (neighbouring voxels) gather almost
// the same correlation entries, and in step they find them in L1. Each row is
// summed by group_dot<L> exactly as in csr_vector_L: the images are
// bit-identical for the same L, whatever the block size, grid or `sync`.
template <int L>
__device__ __forceinline__ void csr_block_body(const i64* __restrict__ rowptr,
                                               const int* __restrict__ col,
                                               const float* __restrict__ val,
                                               const float* __restrict__ x, float* y, i64 m, int mode,
                                               const float* aux0, const float* aux1, int sync,
                                               const i64* __restrict__ rows) {
    const int lane = threadIdx.x & (L - 1);
    const i64 per_block = blockDim.x / L;
    const i64 step = (i64)gridDim.x * per_block;
    i64 base = (i64)blockIdx.x * per_block;
    RowHead h = load_head(base + threadIdx.x / L, m, lane == 0, rowptr, rows, mode, aux0, aux1);
    for (; base < m; base += step) {
        const i64 r = base + threadIdx.x / L;
        const RowHead next = load_head(r + step, m, lane == 0, rowptr, rows, mode, aux0, aux1);
        float sum = group_dot<L>(h.s, h.e, col, val, x, lane);
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off, L);
        if (r < m && lane == 0) write_row(mode, h.ry, sum, y, h.pre);
        h = next;
        if (sync) __syncthreads();
    }
}

#define CSR_BLOCK(L)                                                                              \
    extern "C" __global__ void __launch_bounds__(1024, MLEM_BLOCK_MINB) csr_block_##L(                            \
        const i64* __restrict__ rowptr, const int* __restrict__ col,                              \
        const float* __restrict__ val, const float* __restrict__ x, float* y, i64 m, int mode,   \
        const float* aux0, const float* aux1, int sync, const i64* rows) {                        \
        csr_block_body<L>(rowptr, col, val, x, y, m, mode, aux0, aux1, sync, rows);              \
    }
CSR_BLOCK(8)
CSR_BLOCK(16)
CSR_BLOCK(32)

// ---------------------------------------------------------------------------
// csr_row_L. The back projection on A^T is held by L2: its gathers of
// the correlation use 12 bytes of each 32-byte sector, and a multiprocessor's L1 serves 60% of them
// with 32 warps of csr_block_L (64 registers). With 64 warps of neighbouring rows (voxels) in flight
// the L1 serves 64%, which needs the row's dot product in 32 registers without spills and with the
// trip's two 16-byte loads issued before its gathers (else each trip waits for DRAM twice). So:
// one row per group (no next row loaded ahead), offsets of 32 bits within the row, the head and the
// tail (at most 3 elements each) as one masked step, the values' load before the columns' (ptxas
// then keeps both ahead of the gathers; the other order put the values' load after the first
// gather), the epilogue's operands loaded after the sum. group_dot_lean gives each lane the same
// elements in the same order as group_dot, so the sums are the same bits.
template <int L>
__device__ __forceinline__ float group_dot_lean(i64 s, int len, const int* __restrict__ col,
                                                const float* __restrict__ val,
                                                const float* __restrict__ x, int lane) {
    static_assert(L >= 4, "the head and the tail (at most 3 elements each) take one trip");
    const int* __restrict__ cb = col + (s & ~(i64)3);
    const float* __restrict__ vb = val + (s & ~(i64)3);
    const int o = (int)(s & 3);
    const int a = (o + 3) & ~3;
    const int e = o + len;
    float sum = 0.0f;
    const int head_end = a < e ? a : e;
    if (o + lane < head_end) sum += LDM(vb + o + lane) * __ldg(x + LDM(cb + o + lane));
    const int qe = e >> 2;
    const int4* __restrict__ cb4 = reinterpret_cast<const int4*>(cb);
    const float4* __restrict__ vb4 = reinterpret_cast<const float4*>(vb);
#pragma unroll MLEM_VEC_UNROLL
    for (int q = (a >> 2) + lane; q < qe; q += L) {
        const float4 v = LDM(vb4 + q);
        const int4 c = LDM(cb4 + q);
        sum = quad_dot(sum, c, v, x);
    }
    const int t = ((qe << 2) > a ? (qe << 2) : a) + lane;
    if (t < e) sum += LDM(vb + t) * __ldg(x + LDM(cb + t));
    return sum;
}

template <int L>
__device__ __forceinline__ void csr_row_body(const i64* __restrict__ rowptr, const int* __restrict__ col,
                                             const float* __restrict__ val, const float* __restrict__ x,
                                             float* y, i64 m, int mode, const float* aux0,
                                             const float* aux1, const i64* __restrict__ rows) {
    const int lane = threadIdx.x & (L - 1);
    const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / L;
    if (r - (threadIdx.x & 31) / L >= m) return;  // the whole warp: the shuffles below need every lane
    i64 ry = r, s = 0;
    int len = 0;
    if (r < m) {
        if (rows != nullptr) ry = rows[r];
        s = rowptr[ry];
        len = (int)(rowptr[ry + 1] - s);
    }
    float sum = group_dot_lean<L>(s, len, col, val, x, lane);
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off, L);
    if (r < m && lane == 0) write_row(mode, ry, sum, y, load_aux(mode, ry, aux0, aux1));
}

// Threads per block csr_row_L's register budget is set for (its __launch_bounds__, with
// MLEM_BLOCK_MINB blocks): 1024 x 2 gives 32 registers, 768 x 2 gives 40.
#ifndef MLEM_ROW_BOUND
#define MLEM_ROW_BOUND 1024
#endif
#define CSR_ROW(L)                                                                                \
    extern "C" __global__ void __launch_bounds__(MLEM_ROW_BOUND, MLEM_BLOCK_MINB) csr_row_##L(                      \
        const i64* __restrict__ rowptr, const int* __restrict__ col,                              \
        const float* __restrict__ val, const float* __restrict__ x, float* y, i64 m, int mode,   \
        const float* aux0, const float* aux1, const i64* rows) {                                  \
        csr_row_body<L>(rowptr, col, val, x, y, m, mode, aux0, aux1, rows);                      \
    }
CSR_ROW(8)
CSR_ROW(16)
CSR_ROW(32)

// ---------------------------------------------------------------------------
// csr_interleave: a row's 16-byte part (quads ceil(s/4) .. floor(e/4), as group_dot loads them)
// falls into trips of L quads (the last of Q < L). In the interleaved layout (inverse == 0) the
// trip's element j = k Q + l (in column order) sits in slot 4 l + k: lane l's int4/float4 loads
// then hold the elements l, Q + l, 2 Q + l, 3 Q + l, and each of the group's four gathers reads Q
// consecutive elements of the row (neighbouring columns: few cache lines per instruction) instead
// of every fourth one. inverse == 1 puts column order back. The
// row's head and tail (loaded one element per lane) stay where they are. One warp per row, in
// place: a trip's loads all come before its stores, and no other warp touches the row.
extern "C" __global__ void csr_interleave(const i64* __restrict__ rowptr, i64 m, int* col, float* val, int L,
                                          int inverse) {
    const int lane = threadIdx.x & 31;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < m; r += warps) {
        const i64 qa = (rowptr[r] + 3) >> 2, qe = rowptr[r + 1] >> 2;
        for (i64 q0 = qa; q0 < qe; q0 += L) {
            const i64 Q = (qe - q0) < L ? (qe - q0) : L;
            const bool in = lane < Q;
            int4 c = make_int4(0, 0, 0, 0);
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (in) {
                c = reinterpret_cast<const int4*>(col)[q0 + lane];
                v = reinterpret_cast<const float4*>(val)[q0 + lane];
            }
            __syncwarp();
            if (in) {
                const int cc[4] = {c.x, c.y, c.z, c.w};
                const float vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    i64 d;
                    if (inverse) {
                        d = k * Q + lane;  // slot 4 lane + k holds element k Q + lane
                    } else {
                        const i64 j = 4 * lane + k;
                        d = 4 * (j % Q) + j / Q;
                    }
                    col[4 * q0 + d] = cc[k];
                    val[4 * q0 + d] = vv[k];
                }
            }
            __syncwarp();
        }
    }
}

// ---------------------------------------------------------------------------
// merge_spmv: the merge-based SpMV of the thesis (5.1, Merrill & Garland).
// The merge list is the m row ends (rowptr[1..m]) merged with the nnz indices
// 0..nnz-1; thread t starts at diagonal d = t * secsize (found by binary
// search along the diagonal) and consumes `secsize` items: a non-zero adds to
// the running row sum, a row end flushes the sum into y with atomicAdd. y must
// be zero on entry. Rows split between threads are summed in an order that
// depends on timing: not deterministic.
extern "C" __global__ void merge_spmv(const i64* __restrict__ rowptr, const int* __restrict__ col,
                                      const float* __restrict__ val, const float* __restrict__ x,
                                      float* __restrict__ y, i64 m, i64 nnz, int secsize) {
    const i64 total = m + nnz;
    const i64 nthreads = (total + secsize - 1) / secsize;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < nthreads; t += stride) {
        const i64 d = t * secsize;
        const i64 dend = (d + secsize < total) ? d + secsize : total;
        // merge-path search: the split (i, j = d - i) with rowptr[i] ... see Merrill's MergePathSearch
        i64 lo = d - nnz > 0 ? d - nnz : 0;
        i64 hi = d < m ? d : m;
        while (lo < hi) {
            const i64 pivot = (lo + hi) >> 1;
            if (rowptr[pivot + 1] <= d - pivot - 1)
                lo = pivot + 1;
            else
                hi = pivot;
        }
        i64 i = lo, j = d - lo;
        float sum = 0.0f;
        for (i64 k = d; k < dend; ++k) {
            if (i < m && j < rowptr[i + 1]) {
                sum += __ldg(val + j) * __ldg(x + __ldg(col + j));
                ++j;
            } else {
                if (sum != 0.0f) atomicAdd(y + i, sum);
                sum = 0.0f;
                ++i;
            }
        }
        if (i < m && sum != 0.0f) atomicAdd(y + i, sum);
    }
}

// ---------------------------------------------------------------------------
// scatter: out[j] += a_ij * c_i for every non-zero, from the rows of A (no
// transpose). Rows with c_i == 0 are skipped (their non-zeros add nothing),
// which saves reading them when the measurement has empty bins. out must be
// zero on entry.
//
// Launch order: lane group w takes row (w * P) mod m (spread_rows in epilogue.cuh with units of
// one row; P = 1: in order): rows in flight together then scatter into voxels far apart, which
// spreads the atomics over L2. Each row is still read whole and in place.
template <int L, bool VEC>
__device__ __forceinline__ void scatter_body(const i64* __restrict__ rowptr,
                                             const int* __restrict__ col,
                                             const float* __restrict__ val,
                                             const float* __restrict__ c, float* out, i64 m, i64 P) {
    const int lane = threadIdx.x & (L - 1);
    const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 ngroups = ((i64)gridDim.x * blockDim.x) / L;
    if (!VEC) {
        // One element per lane per trip: a warp's atomic instruction covers L consecutive
        // elements of a row, a few sectors of `out`; the L2 cache, which bounds this
        // kernel, serves atomics by the sectors they touch.
        // One row per lane group and no row loop: launched with a group for every row.
        // The lanes of a group take the same trips (a predicate per element, no divergent exit).
        const i64 w = gtid / L;
        if (w >= m) return;
        const i64 r = spread_rows(w, P, 1, m);
        const float cr = __ldg(c + r);
        if (cr == 0.0f) return;
        const i64 s = rowptr[r], e = rowptr[r + 1];
        i64 k0 = s;
        // SCATTER_UNROLL trips' loads before their atomics, so their latency overlaps
        for (; k0 + (SCATTER_UNROLL - 1) * L < e; k0 += SCATTER_UNROLL * L) {
            unsigned cc[SCATTER_UNROLL];
            float vv[SCATTER_UNROLL];
#pragma unroll
            for (int u = 0; u < SCATTER_UNROLL; ++u) {
                const i64 k = k0 + u * L + lane;
                cc[u] = k < e ? (unsigned)__ldcs(col + k) : 0u;
                vv[u] = k < e ? __ldcs(val + k) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < SCATTER_UNROLL; ++u)
                if (k0 + u * L + lane < e) atomicAdd(out + cc[u], vv[u] * cr);
        }
        for (; k0 < e; k0 += L) {
            const i64 k = k0 + lane;
            if (k < e) atomicAdd(out + (unsigned)__ldcs(col + k), __ldcs(val + k) * cr);
        }
        return;
    }
    // scatter_vec: 4 consecutive elements per lane (16-byte loads), vector atomics where
    // they are 4 (or 2 + 2) consecutive aligned columns.
    const int4* __restrict__ col4 = reinterpret_cast<const int4*>(col);
    const float4* __restrict__ val4 = reinterpret_cast<const float4*>(val);
    for (i64 w = gtid / L; w < m; w += ngroups) {
        const i64 r = spread_rows(w, P, 1, m);
        const float cr = __ldg(c + r);
        if (cr == 0.0f) continue;
        const i64 s = rowptr[r], e = rowptr[r + 1];
        const i64 a = (s + 3) & ~(i64)3;
        const i64 head_end = a < e ? a : e;
        for (i64 k = s + lane; k < head_end; k += L) atomicAdd(out + __ldg(col + k), __ldg(val + k) * cr);
        const i64 qe = e >> 2;
#pragma unroll 2
        for (i64 q = (a >> 2) + lane; q < qe; q += L) {
            const int4 cc = __ldg(col4 + q);
            const float4 v = __ldg(val4 + q);
#ifdef MLEM_VECTOR_ATOMICS
            if (VEC && cc.y == cc.x + 1 && cc.z == cc.x + 2 && cc.w == cc.x + 3 && (cc.x & 3) == 0) {
                atomicAdd(reinterpret_cast<float4*>(out + cc.x),
                          make_float4(v.x * cr, v.y * cr, v.z * cr, v.w * cr));
            } else if (VEC && cc.y == cc.x + 1 && (cc.x & 1) == 0 && cc.w == cc.z + 1 && (cc.z & 1) == 0) {
                atomicAdd(reinterpret_cast<float2*>(out + cc.x), make_float2(v.x * cr, v.y * cr));
                atomicAdd(reinterpret_cast<float2*>(out + cc.z), make_float2(v.z * cr, v.w * cr));
            } else
#endif
            {
                atomicAdd(out + cc.x, v.x * cr);
                atomicAdd(out + cc.y, v.y * cr);
                atomicAdd(out + cc.z, v.z * cr);
                atomicAdd(out + cc.w, v.w * cr);
            }
        }
        const i64 t0 = (qe << 2) > a ? (qe << 2) : a;
        for (i64 k = t0 + lane; k < e; k += L) atomicAdd(out + __ldg(col + k), __ldg(val + k) * cr);
    }
}

#define SCATTER(L)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1) scatter_##L(                             \
        const i64* __restrict__ rowptr, const int* __restrict__ col,                            \
        const float* __restrict__ val, const float* __restrict__ c, float* out, i64 m, i64 P) { \
        scatter_body<L, false>(rowptr, col, val, c, out, m, P);                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256, 1) scatter_vec_##L(                         \
        const i64* __restrict__ rowptr, const int* __restrict__ col,                            \
        const float* __restrict__ val, const float* __restrict__ c, float* out, i64 m, i64 P) { \
        scatter_body<L, true>(rowptr, col, val, c, out, m, P);                                  \
    }
SCATTER(2)
SCATTER(4)
SCATTER(8)
SCATTER(16)
SCATTER(32)

// ---------------------------------------------------------------------------
// scatter_smem: one block per chunk of rows [crow[b], crow[b+1]) (chunks are
// nnz-balanced on the host side). When the chunk's columns lie in a window
// [cmin[b], cmax[b]] of at most `win` floats, the block accumulates into that
// window in shared memory (shared-memory atomics) and then adds the window's
// non-zero entries to out with one global atomic each; otherwise it adds
// straight into out. Each warp takes one row at a time. out must be zero on
// entry. Dynamic shared memory: win * 4 bytes.
extern __shared__ float acc[];  // dynamic shared memory of scatter_smem

template <bool LOCAL>
__device__ __forceinline__ void scatter_chunk(const i64* __restrict__ rowptr,
                                              const int* __restrict__ col,
                                              const float* __restrict__ val,
                                              const float* __restrict__ c, float* dst, i64 r0,
                                              i64 r1, int lo) {
    const int lane = threadIdx.x & 31;
    const int nwarps = blockDim.x >> 5;
    const int4* __restrict__ col4 = reinterpret_cast<const int4*>(col);
    const float4* __restrict__ val4 = reinterpret_cast<const float4*>(val);
    for (i64 r = r0 + (threadIdx.x >> 5); r < r1; r += nwarps) {
        const float cr = __ldg(c + r);
        if (cr == 0.0f) continue;
        const i64 s = rowptr[r], e = rowptr[r + 1];
        const i64 a = (s + 3) & ~(i64)3;
        const i64 head_end = a < e ? a : e;
        const i64 qe = e >> 2;
        const i64 t0 = (qe << 2) > a ? (qe << 2) : a;
        for (i64 k = s + lane; k < head_end; k += 32) {
            const int j = __ldg(col + k);
            if (LOCAL) atomicAdd(acc + (j - lo), __ldg(val + k) * cr);
            else atomicAdd(dst + j, __ldg(val + k) * cr);
        }
#pragma unroll 2
        for (i64 q = (a >> 2) + lane; q < qe; q += 32) {
            const int4 cc = __ldg(col4 + q);
            const float4 v = __ldg(val4 + q);
            if (LOCAL) {
                atomicAdd(acc + (cc.x - lo), v.x * cr);
                atomicAdd(acc + (cc.y - lo), v.y * cr);
                atomicAdd(acc + (cc.z - lo), v.z * cr);
                atomicAdd(acc + (cc.w - lo), v.w * cr);
            } else {
                atomicAdd(dst + cc.x, v.x * cr);
                atomicAdd(dst + cc.y, v.y * cr);
                atomicAdd(dst + cc.z, v.z * cr);
                atomicAdd(dst + cc.w, v.w * cr);
            }
        }
        for (i64 k = t0 + lane; k < e; k += 32) {
            const int j = __ldg(col + k);
            if (LOCAL) atomicAdd(acc + (j - lo), __ldg(val + k) * cr);
            else atomicAdd(dst + j, __ldg(val + k) * cr);
        }
    }
}

extern "C" __global__ void scatter_smem(const i64* __restrict__ rowptr, const int* __restrict__ col,
                                        const float* __restrict__ val, const float* __restrict__ c,
                                        float* out, const i64* __restrict__ crow,
                                        const int* __restrict__ cmin, const int* __restrict__ cmax,
                                        int win) {
    const int b = blockIdx.x;
    const i64 r0 = crow[b], r1 = crow[b + 1];
    const int lo = cmin[b];
    const int width = cmax[b] - lo + 1;  // <= 0 for a chunk without non-zeros
    if (width <= 0) return;
    if (width <= win) {
        for (int k = threadIdx.x; k < width; k += blockDim.x) acc[k] = 0.0f;
        __syncthreads();
        scatter_chunk<true>(rowptr, col, val, c, out, r0, r1, lo);
        __syncthreads();
        for (int k = threadIdx.x; k < width; k += blockDim.x) {
            const float v = acc[k];
            if (v != 0.0f) atomicAdd(out + lo + k, v);
        }
    } else {
        scatter_chunk<false>(rowptr, col, val, c, out, r0, r1, lo);
    }
}

// chunk_bounds: cmin[b], cmax[b] = smallest and largest column of the
// non-zeros of rows [crow[b], crow[b+1]); (INT_MAX, -1) for an empty chunk.
// One block per chunk.
extern "C" __global__ void chunk_bounds(const i64* __restrict__ rowptr, const int* __restrict__ col,
                                        const i64* __restrict__ crow, int* cmin, int* cmax) {
    __shared__ int smin[32], smax[32];
    const int b = blockIdx.x;
    const i64 s = rowptr[crow[b]], e = rowptr[crow[b + 1]];
    int lo = 0x7fffffff, hi = -1;
    for (i64 k = s + threadIdx.x; k < e; k += blockDim.x) {
        const int v = __ldg(col + k);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, off));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, off));
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        smin[warp] = lo;
        smax[warp] = hi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            lo = min(lo, smin[w]);
            hi = max(hi, smax[w]);
        }
        cmin[b] = lo;
        cmax[b] = hi;
    }
}
