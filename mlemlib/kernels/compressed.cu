// Kernels of the compressed matrix (version 2) and of the one-pass MLEM iteration
// (compiled at run time by cupy.RawModule; launched by mlemlib/backends/_compressed_cuda.py).
//
// The compressed matrix, version 2 (mlemlib/compressed.py, docs/formats.md): row r
// owns slots [p(r), p(r+1)), p(r) = rowbase[r >> 6] + rowoff[r], every p(r) a
// multiple of 4 (rows are padded at their end with pad slots). Per slot a code
// (CB = 8 or 16 bits) and a value slot (float32, or float16 bits or an unsigned
// 16-bit integer, times the row's float32 scale). With MARK = 2^CB - 1 and HIGH = 2^CB - 2: a code below
// HIGH advances the row's running column by the code and the slot is an
// element; MARK advances it by the value slot's bits, HIGH by those bits << 16
// (16-bit values only), and neither holds an element (a pad slot is MARK with bits 0).
// The running column starts at 0 in every row.
//
// Decoding (cspmv, cscatter, conepass): a group of L lanes takes one row; a trip
// covers 4 L slots, 4 per lane: each lane loads its 4 codes (4 or 8 bytes) and
// 4 values (16 or 8 bytes) with one vector load each, forms its 4 deltas and
// their running sum, and an exclusive scan of the lanes' sums over the group
// (log2 L shuffles) plus the running column before the trip gives each slot
// its column. Trip counts are made uniform over the warp so the shuffles are
// legal. The row loop runs over block-aligned row bases (as csr_block_L of
// spmv.cu): launched with one row per group and no grid-stride loop, the rows
// in flight are neighbours and share their gathers in L1.
//
// Kernels (extern "C"; <K> = f32c8, f32c16, f16c8, f16c16, u16c8, u16c16 (values, code bits);
// <L> = 4, 8, 16, 32):
//   cspmv_<K>_<L>          y = A x, fused epilogue `mode` as spmv.cu; also the
//                          back projection on a stored compressed A^T.
//                          Deterministic (no atomics).
//   cscatter_<K>_<L>       out += A^T c from the rows of A, float atomics.
//                          NOT deterministic.
//   cscatter_det_<K>_<L>   the same into 64-bit fixed point; deterministic.
//   conepass_<K>_<L>       one-pass MLEM step on the compressed A: per row
//                          fp = a . f, c = g / fp (0 where fp == 0), bp += c a;
//                          float atomics. NOT deterministic.
//   conepass_det_<K>_<L>   the same in 64-bit fixed point; deterministic.
//   onepass_csr_<L>, onepass_det_csr_<L>   the one-pass step on CSR (one element
//                          per lane per trip).
//   chunked_onepass        the one-pass step through a chunk plan (mlemlib/chunked.py):
//                          shared-memory sums, 64-bit fixed point; deterministic.
//   ccheck_<K>             the upload's check of the rows (columns, values) and their element count.
//   ccount_<K>             each column's element count (the fixed point's limits, add_term).
//   fixed_to_float         out = acc / scale.
//
// One-pass on CSR: the lanes keep the first OP_CACHE trips of their row
// (one element each) in registers between the dot product and the scatter; a
// longer row's tail is read again. One-pass and scatter on the compressed
// format decode the row again for the scatter (registers for the row would cost more
// occupancy than the second decode, which partly hits the caches, more so from the
// row's end back, the order it takes), and hand each
// trip's 4 x L slots through shared memory so that every atomic instruction of a
// warp covers consecutive slots (warp_scatter): the atomics, not the bytes, bound
// these kernels, and the L2 cache serves a warp's atomics by the sectors they
// touch.
//
// Fixed point (the _det kernels): each term t = v * c (>= 0) is added as the
// unsigned 64-bit integer rint(t * scale) with an integer atomicAdd: integer
// sums do not depend on the order, so the result is bit-identical run after run
// and for every GPU count when the partial sums are added as integers. `scale`
// is a power of two from an upper bound B of every output (scale * B <= 2^62);
// an output of K terms is off by at most K / (2 scale) before its final float32
// rounding. A term that does not fit sets bit 0 of *flag, a sum that reaches its
// limit bit 1 (add_term): the caller retries with a larger bound.
//
// Offsets (slots, elements, rows) are 64-bit throughout.

typedef long long i64;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define ROW_SHIFT 6

// Threads per block of the row kernels (the launcher's THREADS).
constexpr int CMP_THREADS = 256;

// Minimum blocks per multiprocessor the CSR one-pass kernels are compiled for: 3 caps them (in
// 256-thread blocks) at 80 registers, which keeps more rows, and their atomics, in flight.
constexpr int OP_MINB = 3;
// Trips (one element per lane each) of a row the CSR one-pass kernels keep in registers.
constexpr int OP_CACHE = 16;

// The chunked one pass: threads per block (one block per chunk, its shared memory a third of a
// multiprocessor's or more), interleaved groups of 128 elements (4 trips) kept in registers between a
// row's dot product and its scatter, and voxels each thread stages (f) and flushes (sums) per batch:
// the loads of a batch are in flight together instead of one dependent pair (voxel number, then f).
constexpr int CHUNK_THREADS = 1024;
constexpr int CHUNK_CACHE = 2;
constexpr int CHUNK_STAGE = 8;

#include "epilogue.cuh"  // MODE_*, RowAux, load_aux, write_row

// IEEE binary16 bits -> float32 (exact), without cuda_fp16.h.
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// A 16-bit unsigned integer -> float32 (exact): 2^23 + u has u in its low mantissa bits; one
// logic op and one add, both full-rate, instead of the conversion pipe's I2F.
__device__ __forceinline__ float u16_to_float(unsigned u) {
    return __uint_as_float(0x4B000000u | (u & 0xFFFFu)) - 8388608.0f;
}

// Value kinds of the compressed kernels (mlemlib.compressed.VALUE_KINDS): float32 values; float16
// (compressed-f16) times the row's power-of-two scale, or unsigned 16-bit integers (compressed-u16)
// times the row's float32 scale.
#define VK_F32 0
#define VK_F16 1
#define VK_U16 2

// The float32 value of a value slot's bits b (row scale rs), computed as the decoder does
// (mlemlib.compressed.decode_slots: float16 times a power of two is exact, the integer times its
// scale is one float32 rounding of the exact product), so the kernels' values are those of the
// decoded CSR bit for bit.
template <int VK>
__device__ __forceinline__ float slot_value(unsigned b, float rs) {
    if (VK == VK_F32) return __uint_as_float(b);
    if (VK == VK_F16) return half_bits_to_float((unsigned short)b) * rs;
    return u16_to_float(b) * rs;
}

__device__ __forceinline__ i64 warp_max(i64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const i64 u = __shfl_xor_sync(FULL_MASK, v, o);
        v = u > v ? u : v;
    }
    return v;
}

// The fixed point's accumulator and limits (the _det kernels' acc, fscale, flag, red_lim, sum_lim;
// empty for the float kernels). See add_term.
struct Fixed {
    u64* acc = nullptr;
    double scale = 0.0;
    int* flag = nullptr;
    u64 red_lim = 0ull;
    u64 sum_lim = 0ull;
};

// Whether old + u, an add to a fixed-point sum that held old, reaches lim (u and old below 2^64,
// no wrap in the test itself): the checked adds of add_term and of the chunked kernel's flush.
__device__ __forceinline__ bool reaches(u64 u, u64 old, u64 lim) { return u >= lim || old >= lim - u; }

// bp[j] += t (float atomic) or fx.acc[j] += u = rint(t * fx.scale) (fixed point). A term u below
// fx.red_lim is added without reading the sum back (a reduction, which the L2 cache serves at about
// twice the rate of an atomic that returns the old value); a larger one returns the old sum, and
// bit 1 of *flag is set when the new sum reaches fx.sum_lim. The caller sets red_lim = 2^63 / K,
// K bounding the terms any one output receives over all GPUs, and sum_lim = 2^63 / P for P GPUs:
// the reductions then add less than 2^63 to an output, the checked adds less than 2^63 over all
// GPUs while no flag is set, and no sum, per GPU or all-reduced, wraps unseen.
template <bool DET>
__device__ __forceinline__ void add_term(float* bp, const Fixed& fx, unsigned j, float t) {
    if (DET) {
        const double q = (double)t * fx.scale;
        if (!(q >= 0.0 && q < 18446744073709551616.0)) {
            atomicOr(fx.flag, 1);
            return;
        }
        const u64 u = __double2ull_rn(q);
        if (u < fx.red_lim) {
            if (u != 0ull) atomicAdd(fx.acc + j, u);
        } else {
            const u64 old = atomicAdd(fx.acc + j, u);
            if (reaches(u, old, fx.sum_lim)) atomicOr(fx.flag, 2);
        }
    } else {
        atomicAdd(bp + j, t);
    }
}

// The two halves of a CSR row's one-pass work for its L lanes, shared by the two bodies
// below. csr_row_dot: the lane's part of row [s, e)'s dot product with f, the first
// OP_CACHE trips (one element per lane each, streaming loads) kept in cc / cv.
// csr_row_scatter: bp += ci * row, the kept trips from registers (STOP: leave them at
// the row's end, where that is uniform over the warp), the tail read again.
template <int L>
__device__ __forceinline__ float csr_row_dot(i64 s, i64 e, int lane, const int* __restrict__ idx,
                                             const float* __restrict__ val, const float* __restrict__ f,
                                             unsigned cc[OP_CACHE], float cv[OP_CACHE]) {
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < OP_CACHE; ++t) {
        const i64 k = s + (i64)L * t + lane;
        cc[t] = 0u;
        cv[t] = 0.0f;
        if (k < e) {
            cc[t] = (unsigned)__ldcs(idx + k);
            cv[t] = __ldcs(val + k);
            sum += cv[t] * __ldg(f + cc[t]);
        }
    }
    for (i64 k = s + (i64)L * OP_CACHE + lane; k < e; k += L) sum += __ldg(val + k) * __ldg(f + __ldg(idx + k));
    return sum;
}

template <int L, bool DET, bool STOP>
__device__ __forceinline__ void csr_row_scatter(i64 s, i64 e, int lane, const int* __restrict__ idx,
                                                const float* __restrict__ val, const unsigned cc[OP_CACHE],
                                                const float cv[OP_CACHE], float ci, float* bp, const Fixed& fx) {
#pragma unroll
    for (int t = 0; t < OP_CACHE; ++t) {
        if (STOP && s + (i64)L * t >= e) break;
        if (cv[t] != 0.0f) add_term<DET>(bp, fx, cc[t], cv[t] * ci);
    }
    for (i64 k = s + (i64)L * OP_CACHE + lane; k < e; k += L) {
        const unsigned j = (unsigned)__ldcs(idx + k);  // both loads before the branch
        const float v = __ldcs(val + k);
        if (v != 0.0f) add_term<DET>(bp, fx, j, v * ci);
    }
}

// One-pass MLEM step on CSR: fp_r = a_r . f, c_r = g_r / fp_r (0 where fp_r == 0),
// bp += c_r a_r. fp (length m) receives fp_r. L lanes per row, one element per lane
// per trip (a warp's atomic covers consecutive elements of a row); the matrix is
// read with streaming loads, the first OP_CACHE trips kept in registers.
// No shuffles inside the row loops: lanes of a warp may take rows of any length.
template <int L, bool DET>
__device__ __forceinline__ void onepass_csr_body(const i64* __restrict__ rp, const int* __restrict__ idx,
                                                 const float* __restrict__ val, const float* __restrict__ f,
                                                 const float* __restrict__ g, const float* __restrict__ bg, float* fp, float* bp, const Fixed& fx, i64 m, i64 P, i64 U) {
    const int lane = threadIdx.x & (L - 1);
    const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 ngroups = ((i64)gridDim.x * blockDim.x) / L;
    const i64 mw = spread_groups(P, U, m);
    for (i64 w = gtid / L; w - (i64)((threadIdx.x & 31) / L) < mw; w += ngroups) {
        const i64 r = w < mw ? spread_rows(w, P, U, m) : m;
        const bool valid = r < m;
        i64 s = 0, e = 0;
        if (valid) {
            s = rp[r];
            e = rp[r + 1];
        }
        unsigned cc[OP_CACHE];
        float cv[OP_CACHE];
        float sum = csr_row_dot<L>(s, e, lane, idx, val, f, cc, cv);
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off, L);
        float ci = 0.0f;
        if (valid) {
            ci = row_ratio(sum, g, bg, r);
            if (lane == 0) fp[r] = sum;
        }
        if (ci != 0.0f) csr_row_scatter<L, DET, false>(s, e, lane, idx, val, cc, cv, ci, bp, fx);
    }
}

// The same for 32 lanes, one row per warp, written for that case: the warp leaves as soon as
// its row is done (rows past m, a zero ratio) and stops the cached scatter at the row's end,
// with the same sums in the same order as onepass_csr_body<32>. Must be launched with a warp
// for every row (the launcher's waves=0).
template <bool DET>
__device__ __forceinline__ void onepass_csr_warp(const i64* __restrict__ rp, const int* __restrict__ idx,
                                                 const float* __restrict__ val, const float* __restrict__ f,
                                                 const float* __restrict__ g, const float* __restrict__ bg, float* fp, float* bp, const Fixed& fx, i64 m, i64 P, i64 U) {
    const int lane = threadIdx.x & 31;
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // one row per warp: no row loop
    if (w >= spread_groups(P, U, m)) return;                           // warp-uniform
    const i64 r = spread_rows(w, P, U, m);
    if (r >= m) return;                                                // warp-uniform
    const i64 s = rp[r], e = rp[r + 1];
    unsigned cc[OP_CACHE];
    float cv[OP_CACHE];
    float sum = csr_row_dot<32>(s, e, lane, idx, val, f, cc, cv);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
    const float ci = row_ratio(sum, g, bg, r);
    if (lane == 0) fp[r] = sum;
    if (ci == 0.0f) return;  // warp-uniform
    csr_row_scatter<32, DET, true>(s, e, lane, idx, val, cc, cv, ci, bp, fx);
}

template <int L, bool DET>
__device__ __forceinline__ void onepass_csr(const i64* __restrict__ rp, const int* __restrict__ idx,
                                            const float* __restrict__ val, const float* __restrict__ f,
                                            const float* __restrict__ g, const float* __restrict__ bg, float* fp, float* bp, const Fixed& fx, i64 m, i64 P, i64 U) {
    if (L == 32) {
        onepass_csr_warp<DET>(rp, idx, val, f, g, bg, fp, bp, fx, m, P, U);
    } else {
        onepass_csr_body<L, DET>(rp, idx, val, f, g, bg, fp, bp, fx, m, P, U);
    }
}

// ---------------------------------------------------------------------------
// Version-2 decoding: 4 slots per lane per trip.

__device__ __forceinline__ i64 cstart(const i64* __restrict__ rb, const unsigned* __restrict__ ro, i64 r) {
    return rb[r >> ROW_SHIFT] + (i64)ro[r];
}

// Load and decode quad q (slots 4q .. 4q+3) when `in`; else 4 empty slots.
// d: the 4 column deltas; v: values (0 for markers); el: element or not.
// Returns the sum of the 4 deltas.
// The codes and values are read with streaming loads (evict first): each is read once per pass.
template <int VK, int CB>
__device__ __forceinline__ unsigned load_quad(const void* __restrict__ codes, const void* __restrict__ vals,
                                               float rs, i64 q, bool in, unsigned d[4], float v[4], bool el[4]) {
    const unsigned MARK = (1u << CB) - 1u;
    const unsigned HIGH = MARK - 1u;
    unsigned c[4], b[4];
    if (in) {
        if (CB == 8) {
            const uchar4 u = __ldcs(reinterpret_cast<const uchar4*>(codes) + q);
            c[0] = u.x; c[1] = u.y; c[2] = u.z; c[3] = u.w;
        } else {
            const ushort4 u = __ldcs(reinterpret_cast<const ushort4*>(codes) + q);
            c[0] = u.x; c[1] = u.y; c[2] = u.z; c[3] = u.w;
        }
        if (VK == VK_F32) {
            const uint4 w = __ldcs(reinterpret_cast<const uint4*>(vals) + q);
            b[0] = w.x; b[1] = w.y; b[2] = w.z; b[3] = w.w;
        } else {
            const ushort4 w = __ldcs(reinterpret_cast<const ushort4*>(vals) + q);
            b[0] = w.x; b[1] = w.y; b[2] = w.z; b[3] = w.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            c[k] = MARK;
            b[k] = 0u;
        }
    }
    unsigned tot = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        el[k] = c[k] < HIGH;
        if (el[k]) {
            d[k] = c[k];
            v[k] = slot_value<VK>(b[k], rs);
        } else {
            d[k] = (c[k] == HIGH) ? (b[k] << 16) : b[k];
            v[k] = 0.0f;
        }
        tot += d[k];
    }
    return tot;
}

// Exclusive scan of t over the L lanes of a group; `all` receives the group's total.
template <int L>
__device__ __forceinline__ unsigned group_excl_scan(unsigned t, int lane, unsigned& all) {
    unsigned inc = t;
#pragma unroll
    for (int o = 1; o < L; o <<= 1) {
        const unsigned u = __shfl_up_sync(FULL_MASK, inc, o, L);
        if (lane >= o) inc += u;
    }
    all = __shfl_sync(FULL_MASK, inc, L - 1, L);
    return inc - t;
}

// The quads [qs, qe) of row r (qs = qe = 0 for a row not taken).
template <int VK>
__device__ __forceinline__ void row_quads(const i64* __restrict__ rb, const unsigned* __restrict__ ro,
                                          const float* __restrict__ scale, i64 r, bool take, i64& qs, i64& qe,
                                          float& rs) {
    qs = 0;
    qe = 0;
    rs = 1.0f;
    if (take) {
        qs = cstart(rb, ro, r) >> 2;
        qe = cstart(rb, ro, r + 1) >> 2;
        if (VK != VK_F32) rs = __ldg(scale + r);
    }
}

template <int L, int VK, int CB>
__device__ __forceinline__ void cspmv_body(const i64* __restrict__ rb, const unsigned* __restrict__ ro,
                                           const void* __restrict__ codes, const void* __restrict__ vals,
                                           const float* __restrict__ scale, const float* __restrict__ x, float* y,
                                           i64 m, int mode, const float* aux0, const float* aux1) {
    constexpr int Q = 1;  // quads (4 slots) per lane per trip
    const int lane = threadIdx.x & (L - 1);
    const i64 per_block = blockDim.x / L;
    const i64 step = (i64)gridDim.x * per_block;
    for (i64 base = (i64)blockIdx.x * per_block; base < m; base += step) {
        const i64 r = base + threadIdx.x / L;
        const bool valid = r < m;
        i64 qs, qe;
        float rs;
        row_quads<VK>(rb, ro, scale, r, valid, qs, qe, rs);
        const RowAux pre = valid && lane == 0 ? load_aux(mode, r, aux0, aux1) : RowAux{0.0f, 0.0f};
        const i64 trips = warp_max((qe - qs + Q * L - 1) / (Q * L));
        float sum = 0.0f;
        unsigned carry = 0u;
#pragma unroll 2
        for (i64 t = 0; t < trips; ++t) {
            unsigned d[Q][4];
            float v[Q][4];
            bool el[Q][4];
            unsigned tot = 0u;
#pragma unroll
            for (int h = 0; h < Q; ++h) {
                const i64 q = qs + (t * L + lane) * Q + h;
                tot += load_quad<VK, CB>(codes, vals, rs, q, q < qe, d[h], v[h], el[h]);
            }
            unsigned all;
            unsigned col = carry + group_excl_scan<L>(tot, lane, all);
#pragma unroll
            for (int h = 0; h < Q; ++h) {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    col += d[h][k];
                    if (el[h][k]) sum += v[h][k] * __ldg(x + col);
                }
            }
            carry += all;
        }
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off, L);
        if (valid && lane == 0) write_row(mode, r, sum, y, pre);
    }
}

// The terms of one trip of a warp (4 slots per lane: columns col[k], terms t[k], 0 for
// no element) added to bp / acc. They pass through shared memory so that atomic k of
// lane l adds slot 32 k + l: each atomic instruction covers 32 consecutive slots, a few
// sectors of the output, instead of every fourth slot of 128. All 32 lanes must call it together.
// A warp's staging slots in shared memory (one set per block, for warp_scatter): each
// lane stores its 4 slots; after the barrier, slot 32 k + l is at c1[32 k + l], v1[32 k + l].
__device__ __forceinline__ void warp_stage(const unsigned col[4], const float t[4], const unsigned*& c1,
                                           const float*& v1) {
    __shared__ uint4 scol[CMP_THREADS / 32][32];
    __shared__ float4 sval[CMP_THREADS / 32][32];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncwarp();
    scol[w][lane] = make_uint4(col[0], col[1], col[2], col[3]);
    sval[w][lane] = make_float4(t[0], t[1], t[2], t[3]);
    __syncwarp();
    c1 = reinterpret_cast<const unsigned*>(scol[w]);
    v1 = reinterpret_cast<const float*>(sval[w]);
}

template <bool DET>
__device__ __forceinline__ void warp_scatter(const unsigned col[4], const float t[4], float* bp, const Fixed& fx) {
    const unsigned* c1;
    const float* v1;
    warp_stage(col, t, c1, v1);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float v = v1[32 * k + lane];
        if (v != 0.0f) add_term<DET>(bp, fx, c1[32 * k + lane], v);
    }
}

// out += A^T c (float atomics, DET false), acc += A^T c in fixed point (DET), or, with COUNT,
// out_j += 1 for every element of column j (c unused): each column's element count, exact below 2^24.
template <int L, int VK, int CB, bool DET, bool COUNT = false>
__device__ __forceinline__ void cscatter_body(const i64* __restrict__ rb, const unsigned* __restrict__ ro,
                                              const void* __restrict__ codes, const void* __restrict__ vals,
                                              const float* __restrict__ scale, const float* __restrict__ c,
                                              float* out, const Fixed& fx, i64 m, i64 P,
                                              i64 U) {
    const int lane = threadIdx.x & (L - 1);
    const i64 per_block = blockDim.x / L;
    const i64 step = (i64)gridDim.x * per_block;
    const i64 mw = spread_groups(P, U, m);
    for (i64 base = (i64)blockIdx.x * per_block; base < mw; base += step) {
        const i64 w = base + threadIdx.x / L;
        const i64 r = w < mw ? spread_rows(w, P, U, m) : m;
        const float cr = r < m ? (COUNT ? 1.0f : __ldg(c + r)) : 0.0f;
        i64 qs, qe;
        float rs;
        row_quads<VK>(rb, ro, scale, r, cr != 0.0f, qs, qe, rs);
        const i64 trips = warp_max((qe - qs + L - 1) / L);
        unsigned carry = 0u;
        for (i64 t = 0; t < trips; ++t) {
            const i64 q = qs + t * L + lane;
            unsigned d[4];
            float v[4];
            bool el[4];
            const unsigned tot = load_quad<VK, CB>(codes, vals, rs, q, q < qe, d, v, el);
            unsigned all;
            unsigned col = carry + group_excl_scan<L>(tot, lane, all);
            unsigned cl[4];
            float tv[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                col += d[k];
                cl[k] = col;
                tv[k] = el[k] ? (COUNT ? 1.0f : v[k] * cr) : 0.0f;
            }
            warp_scatter<DET>(cl, tv, out, fx);
            carry += all;
        }
    }
}

template <int L, int VK, int CB, bool DET>
__device__ __forceinline__ void conepass_body(const i64* __restrict__ rb, const unsigned* __restrict__ ro,
                                              const void* __restrict__ codes, const void* __restrict__ vals,
                                              const float* __restrict__ scale, const float* __restrict__ f,
                                              const float* __restrict__ g, const float* __restrict__ bg, float* fp, float* bp, const Fixed& fx, i64 m, i64 P, i64 U) {
    const int lane = threadIdx.x & (L - 1);
    const i64 per_block = blockDim.x / L;
    const i64 step = (i64)gridDim.x * per_block;
    const i64 mw = spread_groups(P, U, m);
    for (i64 base = (i64)blockIdx.x * per_block; base < mw; base += step) {
        const i64 w = base + threadIdx.x / L;
        const i64 r = w < mw ? spread_rows(w, P, U, m) : m;
        const bool valid = r < m;
        i64 qs, qe;
        float rs;
        row_quads<VK>(rb, ro, scale, r, valid, qs, qe, rs);
        const i64 trips = warp_max((qe - qs + L - 1) / L);
        float sum = 0.0f;
        unsigned carry = 0u;
        for (i64 t = 0; t < trips; ++t) {
            const i64 q = qs + t * L + lane;
            unsigned d[4];
            float v[4];
            bool el[4];
            const unsigned tot = load_quad<VK, CB>(codes, vals, rs, q, q < qe, d, v, el);
            unsigned all;
            unsigned col = carry + group_excl_scan<L>(tot, lane, all);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                col += d[k];
                if (el[k]) sum += v[k] * __ldg(f + col);
            }
            carry += all;
        }
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off, L);
        float ci = 0.0f;
        if (valid) {
            ci = row_ratio(sum, g, bg, r);
            if (lane == 0) fp[r] = sum;
        }
        // The scatter decodes the row again from its last trip back (the lines the dot product read
        // last are the likeliest still in L2): the running column before trip t is the one after it
        // less the trip's total (carry holds the column after the row's last trip).
        if (trips > 0) {  // warp-uniform
            for (i64 s = 0; s < trips; ++s) {
                const i64 t = trips - 1 - s;
                const i64 q = qs + t * L + lane;
                unsigned d[4];
                float v[4];
                bool el[4];
                const unsigned tot = load_quad<VK, CB>(codes, vals, rs, q, q < qe, d, v, el);
                unsigned all;
                const unsigned excl = group_excl_scan<L>(tot, lane, all);
                carry -= all;
                unsigned col = carry + excl;
                unsigned cl[4];
                float tv[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    col += d[k];
                    cl[k] = col;
                    tv[k] = el[k] ? v[k] * ci : 0.0f;
                }
                warp_scatter<DET>(cl, tv, bp, fx);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The chunked one pass (mlemlib/chunked.py's plan of a reordered matrix): one block per
// chunk of consecutive rows; f at the chunk's voxels is staged in shared memory, each row
// (one warp, the first C trips kept in registers) takes its dot product from there, and its
// terms c_r a_rj go into the chunk's shared sums; one global atomic per voxel and chunk.
// Hopper has no native shared-memory float or 64-bit atomic add (both compile to
// ATOMS.CAST.SPIN loops, many times slower), but
// 32-bit integer adds are native: each term is rounded to 64-bit fixed point q < 2^52
// (bound * fscale < 2^52) and added as q mod 2^20 and q >> 20 into two 32-bit words per
// voxel. With at most 4,096 rows per chunk (mlemlib.chunked.MAX_CHUNK_ROWS) neither word
// wraps, no carry is needed, and (hi << 20) + lo goes to the global 64-bit accumulator.
// Integer sums: deterministic, for any order and any number of GPUs sharing fscale.
// fwd_only: fp = A f alone (no scatter). Overflow (a term outside [0, 2^52)) sets flag 1. A
// chunk's sum for a voxel below red_lim (2^63 / K, K bounding the chunks that hold a voxel over all
// GPUs) is added as a reduction; a larger one is checked, and a global sum that reaches sum_lim sets
// flag 2 (2^63 / P on P GPUs: then no GPU's sum and no all-reduced sum wraps unseen; add_term's
// rule). Dynamic shared memory: 3 * window words (f, low, high). Block b takes chunk order[b]
// (mlemlib.chunked.launch_order: the blocks start in index order, so the chunks that end a launch
// are those at the end of order).
//
// Row layout (mlemlib.chunked.interleave): every row starts at a multiple of 4 elements (rows
// padded with zeros: value 0, local index 0), and its first 128 * (len / 128) elements are
// stored by groups of 128 with element 32 t + l of a group at 4 l + t: lane l reads trips
// 4 g .. 4 g + 3 of its row with one 8-byte and one 16-byte load (a quarter of the load
// instructions of one element per lane, four times the bytes in flight per instruction), and
// still takes the same elements, in the same order, as with one element per lane (the sums are
// those of mlemlib.chunked.onepass_fixed). The rest of the row (< 128 elements, up to 4 trips)
// is stored in order and read one element per lane. CG groups and the rest stay in registers
// between the dot product and the scatter; later groups are read again for the scatter.
__device__ __forceinline__ void chunk_put(unsigned* lo, unsigned* hi, unsigned j, float t, double fscale, int& bad) {
    const double QMAX = 4503599627370496.0;  // 2^52
    const double q = (double)t * fscale;
    if (!(q >= 0.0 && q < QMAX)) {
        bad = 1;
    } else if (q > 0.0) {
        const u64 u = __double2ull_rn(q);
        atomicAdd(lo + j, (unsigned)(u & 0xFFFFFull));
        atomicAdd(hi + j, (unsigned)(u >> 20));
    }
}

__device__ __forceinline__ float chunk_dot4(float sum, const float* fl, ushort4 c, float4 v) {
    sum += v.x * fl[c.x];
    sum += v.y * fl[c.y];
    sum += v.z * fl[c.z];
    sum += v.w * fl[c.w];
    return sum;
}

__device__ __forceinline__ void chunk_put4(unsigned* lo, unsigned* hi, ushort4 c, float4 v, float ci, double fscale,
                                           int& bad) {
    chunk_put(lo, hi, c.x, v.x * ci, fscale, bad);
    chunk_put(lo, hi, c.y, v.y * ci, fscale, bad);
    chunk_put(lo, hi, c.z, v.z * ci, fscale, bad);
    chunk_put(lo, hi, c.w, v.w * ci, fscale, bad);
}

// chunk_put with the term already scaled in float32: q = a_ij * (c_i * scale). Where chunk_fast
// holds this is the float32 product a_ij * c_i times the power of two scale exactly (scaling by a
// power of two commutes with float32 rounding while neither product is subnormal or infinite, and
// where one is, the term rounds to 0 or fails the range check in both), so the sums are those of
// chunk_put; one float-to-integer conversion per term instead of two conversions and float64 maths.
template <bool FULL>
__device__ __forceinline__ void chunk_putq(unsigned* lo, unsigned* hi, unsigned j, float q, unsigned& ovf) {
    // q >= 0 or -0 here (values non-negative, checked on upload; chunk_fast admits only a positive
    // normal c_i * scale, the rest take chunk_put). u = rint(q), saturated at 2^64 - 1: u < 2^52 exactly
    // where q < 2^52, so OR-ing u's high word into ovf and testing ovf against 2^20 once per thread is the
    // range check (an overflowed iteration's sums are discarded). FULL (the interleaved groups, where
    // every lane holds an element): the adds run unconditionally, a zero adding nothing, as ptxas turns
    // even a PTX predicate on them into a divergent region per term; else (the row's rest, lanes past
    // its end) only for q > 0.
    const u64 u = __float2ull_rn(q);
    ovf |= (unsigned)(u >> 32);
    if (FULL || q > 0.0f) {
        atomicAdd(lo + j, (unsigned)(u & 0xFFFFFull));
        atomicAdd(hi + j, (unsigned)(u >> 20));
    }
}

__device__ __forceinline__ void chunk_put4q(unsigned* lo, unsigned* hi, ushort4 c, float4 v, float cs, unsigned& ovf) {
    chunk_putq<true>(lo, hi, c.x, v.x * cs, ovf);
    chunk_putq<true>(lo, hi, c.y, v.y * cs, ovf);
    chunk_putq<true>(lo, hi, c.z, v.z * cs, ovf);
    chunk_putq<true>(lo, hi, c.w, v.w * cs, ovf);
}

// Whether chunk_putq gives chunk_put's sums for a row: the scale in [2^-70, 2^100] (so a float32
// product that overflows is >= 2^52 scaled, and one that is subnormal is < 2^-26 scaled: both
// products then fail the range check or round to 0 alike) and c_i * scale a normal float32.
__device__ __forceinline__ bool chunk_fast(float cs, double fscale) {
    return fscale >= 8.470329472543003e-22 && fscale <= 1.2676506002282294e+30 && cs >= 1.1754943508222875e-38f &&
           cs <= 3.4028234663852886e+38f;
}

// The values' group of 4 as float32: float32 values as they are; 16-bit values (compressed-f16: the
// float16 round(a / scale_r) with a power-of-two row scale; compressed-u16: the integer
// rint(a / scale_r) with a float32 row scale) times the row's scale, computed as the format's decoder
// does, so the values are exactly those it decodes to (the sums are those of its decoded CSR).
template <int VK>
struct ChunkVals;
template <>
struct ChunkVals<VK_F32> {
    typedef float T;
    typedef float4 V4;
    __device__ static float4 f4(float4 v, float) { return v; }
    __device__ static float one(const void* val, i64 k, float) { return __ldcs(reinterpret_cast<const float*>(val) + k); }
};
template <>
struct ChunkVals<VK_F16> {
    typedef unsigned short T;
    typedef ushort4 V4;
    __device__ static float4 f4(ushort4 h, float sc) {
        return make_float4(slot_value<VK_F16>(h.x, sc), slot_value<VK_F16>(h.y, sc), slot_value<VK_F16>(h.z, sc),
                           slot_value<VK_F16>(h.w, sc));
    }
    __device__ static float one(const void* val, i64 k, float sc) {
        return slot_value<VK_F16>(__ldcs(reinterpret_cast<const unsigned short*>(val) + k), sc);
    }
};
// compressed-u16: u * sc as one FMA, fma(2^23 + u, sc, -2^23 sc): the float 2^23 + u is the integer's
// two bytes under the exponent byte 0x4B (one byte permute of the loaded word), 2^23 sc is exact, and
// the FMA rounds the exact u * sc once, as slot_value<VK_U16> does: two instructions per value, as
// float16's convert and multiply. Needs 2^23 sc finite: row scales below 2^100 (checked on upload).
// A group's 4 values are loaded as one 8-byte word pair (uint2).
template <>
struct ChunkVals<VK_U16> {
    typedef unsigned short T;
    typedef uint2 V4;
    __device__ static float u(unsigned bits, float sc) {  // bits: 0x4B00uuuu
        return __fmaf_rn(__uint_as_float(bits), sc, -8388608.0f * sc);
    }
    __device__ static float4 f4(uint2 w, float sc) {
        return make_float4(u(__byte_perm(w.x, 0x4B000000u, 0x7610), sc), u(__byte_perm(w.x, 0x4B000000u, 0x7632), sc),
                           u(__byte_perm(w.y, 0x4B000000u, 0x7610), sc), u(__byte_perm(w.y, 0x4B000000u, 0x7632), sc));
    }
    __device__ static float one(const void* val, i64 k, float sc) {
        return u(0x4B000000u | (unsigned)__ldcs(reinterpret_cast<const unsigned short*>(val) + k), sc);
    }
};

template <int CG, int VK>
__device__ __forceinline__ void chunked_onepass_body(const int* __restrict__ order, const i64* __restrict__ chunk_rows,
                                                     const i64* __restrict__ vptr, const int* __restrict__ voxels,
                                                     const i64* __restrict__ rp,
                                                     const unsigned short* __restrict__ local,
                                                     const void* __restrict__ val, const float* __restrict__ rscale,
                                                     const float* __restrict__ f,
                                                     const float* __restrict__ g, const float* __restrict__ bg, float* fp, u64* acc,
                                                     double fscale, int* flag, u64 red_lim, u64 sum_lim, int window,
                                                     int fwd_only) {
    typedef ChunkVals<VK> CV;
    typedef typename CV::V4 V4;
    constexpr int SU = CHUNK_STAGE;
    extern __shared__ float chunk_sm[];
    __shared__ int chunk_next;
    // Shared memory: f, low and high words of the sums, window words each.
    float* fl = chunk_sm;
    unsigned* lo = reinterpret_cast<unsigned*>(chunk_sm + window);
    unsigned* hi = lo + window;
    const i64 c = order[blockIdx.x];  // blocks start in launch order; chunk c keeps its rows and voxels
    const i64 v0 = vptr[c];
    const int nv = (int)(vptr[c + 1] - v0);
    const i64 r0 = chunk_rows[c];
    const i64 r1 = chunk_rows[c + 1];
    if (nv == 0) {  // only empty rows (the reorder stage puts them last): A f is 0 there, nothing to add
        for (i64 r = r0 + threadIdx.x; r < r1; r += blockDim.x) fp[r] = 0.0f;
        return;  // uniform over the block
    }
    const int nw = blockDim.x >> 5;
    if (threadIdx.x == 0) chunk_next = nw;
    for (int i0 = threadIdx.x; i0 < nv; i0 += SU * blockDim.x) {
        int vx[SU];
#pragma unroll
        for (int u = 0; u < SU; ++u) {
            const int i = i0 + u * blockDim.x;
            vx[u] = i < nv ? __ldg(voxels + v0 + i) : 0;
        }
        float fv[SU];
#pragma unroll
        for (int u = 0; u < SU; ++u) fv[u] = i0 + u * (int)blockDim.x < nv ? __ldg(f + vx[u]) : 0.0f;
#pragma unroll
        for (int u = 0; u < SU; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < nv) {
                fl[i] = fv[u];
                lo[i] = 0u;
                hi[i] = 0u;
            }
        }
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    int bad = 0;
    unsigned ovf = 0u;  // the high words of this thread's float32-scaled terms (chunk_putq)
    // A warp loads its next row's bounds and measurement while it works on the current row, and takes
    // its rows from a shared counter (rows of unequal length balance over the warps).
    i64 ps = 0, pe = 0;
    float pg = 0.0f, pb = 0.0f;
    if (r0 + (threadIdx.x >> 5) < r1) {
        const i64 r = r0 + (threadIdx.x >> 5);
        ps = rp[r];
        pe = rp[r + 1];
        pg = fwd_only ? 0.0f : __ldg(g + r);  // g is not an m-vector with fwd_only
        pb = (fwd_only || bg == nullptr) ? 0.0f : __ldg(bg + r);
    }
    for (i64 r = r0 + (threadIdx.x >> 5); r < r1;) {  // warp-uniform
        int nx = 0;
        if (lane == 0) nx = atomicAdd(&chunk_next, 1);  // this warp's next row
        const i64 s = ps, e = pe;
        const float gr = pg, br = pb;
        const i64 rn = r0 + __shfl_sync(FULL_MASK, nx, 0);
        if (rn < r1) {
            ps = rp[rn];
            pe = rp[rn + 1];
            pg = fwd_only ? 0.0f : __ldg(g + rn);
            pb = (fwd_only || bg == nullptr) ? 0.0f : __ldg(bg + rn);
        }
        const int ng = (int)((e - s) >> 7);  // interleaved groups of 128
        const i64 t0 = s + ((i64)ng << 7);   // the rest, in order: [t0, e), at most 4 trips
        const float sc = VK != VK_F32 ? __ldg(rscale + r) : 1.0f;
        const ushort4* __restrict__ lq = reinterpret_cast<const ushort4*>(local + s) + lane;
        const V4* __restrict__ vq = reinterpret_cast<const V4*>(reinterpret_cast<const typename CV::T*>(val) + s) + lane;
        ushort4 cc[CG > 0 ? CG : 1];
        V4 cv[CG > 0 ? CG : 1];
        unsigned rc[4];
        float rv[4];
#pragma unroll
        for (int q = 0; q < CG; ++q) {
            cc[q] = make_ushort4(0, 0, 0, 0);
            cv[q] = V4();
            if (q < ng) {
                cc[q] = __ldcs(lq + 32 * q);
                cv[q] = __ldcs(vq + 32 * q);
            }
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const i64 k = t0 + 32 * t + lane;
            rc[t] = 0u;
            rv[t] = 0.0f;
            if (k < e) {
                rc[t] = __ldcs(local + k);
                rv[t] = CV::one(val, k, sc);
            }
        }
        float sum = 0.0f;
#pragma unroll
        for (int q = 0; q < CG; ++q) sum = chunk_dot4(sum, fl, cc[q], CV::f4(cv[q], sc));
#pragma unroll 2
        for (int q = CG; q < ng; ++q) sum = chunk_dot4(sum, fl, __ldg(lq + 32 * q), CV::f4(__ldg(vq + 32 * q), sc));
#pragma unroll
        for (int t = 0; t < 4; ++t) sum += rv[t] * fl[rc[t]];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
        if (lane == 0) fp[r] = sum;
        const float d = bg != nullptr ? sum + br : sum;  // the ratio as row_ratio, with g and bg prefetched
        const float ci = (d != 0.0f && !fwd_only) ? gr / d : 0.0f;
        if (ci != 0.0f) {  // warp-uniform
            const float cs = ci * (float)fscale;
            if (chunk_fast(cs, fscale)) {
#pragma unroll
                for (int q = 0; q < CG; ++q) {
                    if (q >= ng) break;  // warp-uniform
                    chunk_put4q(lo, hi, cc[q], CV::f4(cv[q], sc), cs, ovf);
                }
                for (int q = CG; q < ng; ++q)
                    chunk_put4q(lo, hi, __ldcs(lq + 32 * q), CV::f4(__ldcs(vq + 32 * q), sc), cs, ovf);
#pragma unroll
                for (int t = 0; t < 4; ++t) chunk_putq<false>(lo, hi, rc[t], rv[t] * cs, ovf);  // zeros add nothing
            } else {
#pragma unroll
                for (int q = 0; q < CG; ++q) {
                    if (q >= ng) break;  // warp-uniform
                    chunk_put4(lo, hi, cc[q], CV::f4(cv[q], sc), ci, fscale, bad);
                }
                for (int q = CG; q < ng; ++q)
                    chunk_put4(lo, hi, __ldcs(lq + 32 * q), CV::f4(__ldcs(vq + 32 * q), sc), ci, fscale, bad);
#pragma unroll
                for (int t = 0; t < 4; ++t) chunk_put(lo, hi, rc[t], rv[t] * ci, fscale, bad);  // zeros add nothing
            }
        }
        r = rn;
    }
    if (bad || ovf >= (1u << 20)) atomicOr(flag, 1);  // a term >= 2^52
    if (fwd_only) return;  // uniform over the block
    __syncthreads();
    for (int i0 = threadIdx.x; i0 < nv; i0 += SU * blockDim.x) {
        int vx[SU];
        u64 uu[SU];
#pragma unroll
        for (int u = 0; u < SU; ++u) {
            const int i = i0 + u * blockDim.x;
            uu[u] = 0ull;
            vx[u] = 0;
            if (i < nv) {
                uu[u] = ((u64)hi[i] << 20) + (u64)lo[i];
                vx[u] = __ldg(voxels + v0 + i);
            }
        }
        int wrapped = 0;
#pragma unroll
        for (int u = 0; u < SU; ++u) {
            if (uu[u] == 0ull) continue;
            if (uu[u] < red_lim) {
                atomicAdd(acc + vx[u], uu[u]);  // a reduction (RED): the sum is not read back
            } else {
                const u64 old = atomicAdd(acc + vx[u], uu[u]);
                wrapped |= reaches(uu[u], old, sum_lim);
            }
        }
        if (wrapped) atomicOr(flag, 2);
    }
}

// ---------------------------------------------------------------------------
// Entry points. The compressed kernels take the matrix as (rowbase, rowoff, codes, values, scale);
// the CSR one-pass kernels as (indptr, indptr (unused), indices, data, data (unused)).

#define CMP_KERNELS(K, VK, CB, L)                                                                          \
    extern "C" __global__ void __launch_bounds__(CMP_THREADS) cspmv_##K##_##L(                        \
        const i64* rb, const unsigned* ro, const void* codes, const void* vals, const float* scale,        \
        const float* x, float* y, i64 m, int mode, const float* aux0, const float* aux1) {                 \
        cspmv_body<L, VK, CB>(rb, ro, codes, vals, scale, x, y, m, mode, aux0, aux1);                   \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(CMP_THREADS) cscatter_##K##_##L(                     \
        const i64* rb, const unsigned* ro, const void* codes, const void* vals, const float* scale,        \
        const float* c, float* out, i64 m, i64 P, i64 U) {                                                 \
        cscatter_body<L, VK, CB, false>(rb, ro, codes, vals, scale, c, out, Fixed{}, m, P, U); \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(CMP_THREADS) cscatter_det_##K##_##L(                 \
        const i64* rb, const unsigned* ro, const void* codes, const void* vals, const float* scale,        \
        const float* c, u64* acc, double fscale, int* flag, u64 red_lim, u64 sum_lim, i64 m, i64 P, i64 U) {                         \
        cscatter_body<L, VK, CB, true>(rb, ro, codes, vals, scale, c, nullptr, Fixed{acc, fscale, flag, red_lim, sum_lim}, m, P, U); \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(CMP_THREADS, 1) conepass_##K##_##L(                     \
        const i64* rb, const unsigned* ro, const void* codes, const void* vals, const float* scale,        \
        const float* f, const float* g, const float* bg, float* fp, float* bp, i64 m, i64 P, i64 U) {                       \
        conepass_body<L, VK, CB, false>(rb, ro, codes, vals, scale, f, g, bg, fp, bp, Fixed{}, m, P, U); \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(CMP_THREADS, 1) conepass_det_##K##_##L(                 \
        const i64* rb, const unsigned* ro, const void* codes, const void* vals, const float* scale,        \
        const float* f, const float* g, const float* bg, float* fp, u64* acc, double fscale, int* flag, u64 red_lim, u64 sum_lim, i64 m, i64 P, i64 U) { \
        conepass_body<L, VK, CB, true>(rb, ro, codes, vals, scale, f, g, bg, fp, nullptr, Fixed{acc, fscale, flag, red_lim, sum_lim}, m, P, U); \
    }

#define ALL_KINDS(L)                     \
    CMP_KERNELS(f32c8, VK_F32, 8, L)     \
    CMP_KERNELS(f32c16, VK_F32, 16, L)   \
    CMP_KERNELS(f16c8, VK_F16, 8, L)     \
    CMP_KERNELS(f16c16, VK_F16, 16, L)   \
    CMP_KERNELS(u16c8, VK_U16, 8, L)     \
    CMP_KERNELS(u16c16, VK_U16, 16, L)

ALL_KINDS(4)
ALL_KINDS(8)
ALL_KINDS(16)
ALL_KINDS(32)

#define CSR_ONEPASS(L)                                                                                     \
    extern "C" __global__ void __launch_bounds__(CMP_THREADS, OP_MINB) onepass_csr_##L(                        \
        const i64* rp, const unsigned* roff, const void* idx, const void* val, const float* scale,          \
        const float* f, const float* g, const float* bg, float* fp, float* bp, i64 m, i64 P, i64 U) {                       \
        onepass_csr<L, false>(rp, (const int*)idx, (const float*)val, f, g, bg, fp, bp, Fixed{}, m, P, U); \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(CMP_THREADS, OP_MINB) onepass_det_csr_##L(                    \
        const i64* rp, const unsigned* roff, const void* idx, const void* val, const float* scale,          \
        const float* f, const float* g, const float* bg, float* fp, u64* acc, double fscale, int* flag, u64 red_lim, u64 sum_lim, i64 m, i64 P, i64 U) { \
        onepass_csr<L, true>(rp, (const int*)idx, (const float*)val, f, g, bg, fp, nullptr, Fixed{acc, fscale, flag, red_lim, sum_lim}, m, P, U); \
    }
CSR_ONEPASS(4)
CSR_ONEPASS(8)
CSR_ONEPASS(16)
CSR_ONEPASS(32)

// The chunked one pass (chunked_onepass_body above): one block of CHUNK_THREADS per chunk,
// CG interleaved groups (4 trips each) and the row's rest in registers; chunked_onepass reads
// float32 values, _f16 float16 and _u16 unsigned 16-bit values times the row scales (a
// compressed-f16 / compressed-u16 matrix's).
#define CHUNKED_ONEPASS(NAME, CG, VK)                                                                      \
    extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) NAME(                                \
        const int* order, const i64* chunk_rows, const i64* vptr, const int* voxels, const i64* rp,          \
        const unsigned short* local, const void* val, const float* rscale, const float* f, const float* g,      \
        const float* bg, float* fp, u64* acc, double fscale, int* flag, u64 red_lim, u64 sum_lim, int window,   \
        int fwd_only) {                                                                                    \
        chunked_onepass_body<CG, VK>(order, chunk_rows, vptr, voxels, rp, local, val, rscale, f, g, bg, fp, acc, fscale, \
                                     flag, red_lim, sum_lim, window, fwd_only);                           \
    }
CHUNKED_ONEPASS(chunked_onepass, CHUNK_CACHE, VK_F32)
CHUNKED_ONEPASS(chunked_onepass_f16, CHUNK_CACHE, VK_F16)
CHUNKED_ONEPASS(chunked_onepass_u16, CHUNK_CACHE, VK_U16)

// The upload's check of rows [0, m) (mlemlib.compressed.check_slots's, on the device): a warp per
// row sums its slots' column advances and looks at its elements' value bits. A row is bad where its
// running column reaches n (the column only grows, so its end decides), where a float32 row holds a
// high marker, or where an element's value is not finite or below 0 (the sign bit and any other bit:
// -0 passes, as -0.0 >= 0; 16-bit integer values always pass). first_bad gets the smallest bad row (atomicMin), nnz the elements (codes
// below HIGH) of every row. The host reads the first bad row's piece again and checks it on the CPU
// for its one-line message.
template <int VK, int CB>
__device__ void ccheck_body(const i64* __restrict__ rb, const unsigned* __restrict__ ro, const void* codes,
                            const void* vals, i64 m, i64 n, u64* first_bad, u64* nnz) {
    constexpr unsigned HIGH = (1u << CB) - 2u;
    const int lane = threadIdx.x & 31;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    u64 count = 0;
    for (i64 r = (((i64)blockIdx.x * blockDim.x) + threadIdx.x) >> 5; r < m; r += warps) {
        const i64 s0 = rb[r >> ROW_SHIFT] + ro[r];
        const i64 s1 = rb[(r + 1) >> ROW_SHIFT] + ro[r + 1];
        i64 adv = 0;
        bool bad = false;
        for (i64 s = s0 + lane; s < s1; s += 32) {
            const unsigned c = CB == 8 ? (unsigned)((const unsigned char*)codes)[s]
                                       : (unsigned)((const unsigned short*)codes)[s];
            const unsigned b = VK == VK_F32 ? ((const unsigned*)vals)[s] : (unsigned)((const unsigned short*)vals)[s];
            if (c < HIGH) {
                adv += c;
                count += 1;
                if (VK == VK_F32) bad |= (b & 0x7F800000u) == 0x7F800000u || (b > 0x80000000u);
                if (VK == VK_F16) bad |= (b & 0x7C00u) == 0x7C00u || (b > 0x8000u);
            } else if (c == HIGH) {
                if (VK == VK_F32) bad = true;
                else adv += (i64)b << 16;
            } else {
                adv += (i64)b;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) adv += __shfl_xor_sync(FULL_MASK, adv, o);
        bad = __any_sync(FULL_MASK, bad) || (s1 > s0 && adv >= n);
        if (lane == 0 && bad) atomicMin(first_bad, (u64)r);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(FULL_MASK, count, o);
    if (lane == 0 && count) atomicAdd(nnz, count);
}

#define CCHECK(K, VK, CB)                                                                                  \
    extern "C" __global__ void __launch_bounds__(CMP_THREADS) ccheck_##K(                                 \
        const i64* rb, const unsigned* ro, const void* codes, const void* vals, i64 m, i64 n, u64* first_bad, \
        u64* nnz) {                                                                                        \
        ccheck_body<VK, CB>(rb, ro, codes, vals, m, n, first_bad, nnz);                                    \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(CMP_THREADS) ccount_##K(                                 \
        const i64* rb, const unsigned* ro, const void* codes, const void* vals, const float* scale,        \
        float* out, i64 m, i64 P, i64 U) {                                                                 \
        cscatter_body<32, VK, CB, false, true>(rb, ro, codes, vals, scale, nullptr, out, Fixed{}, m, P, U); \
    }
CCHECK(f32c8, VK_F32, 8)
CCHECK(f32c16, VK_F32, 16)
CCHECK(f16c8, VK_F16, 8)
CCHECK(f16c16, VK_F16, 16)
CCHECK(u16c8, VK_U16, 8)
CCHECK(u16c16, VK_U16, 16)

// out[j] = acc[j] / scale, as float32 (inv_scale = 1 / scale, a power of two).
extern "C" __global__ void fixed_to_float(const u64* __restrict__ acc, float* __restrict__ out, i64 n,
                                          double inv_scale) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        out[j] = (float)((double)acc[j] * inv_scale);
}
