// Kernels on the compressed matrix and the one-pass MLEM iteration (compiled
// at run time by cupy.RawModule; launched by mlemlib/backends/_compressed_cuda.py).
//
// The compressed matrix (mlemlib/compressed.py, docs/formats.md): row r owns
// slots [p(r), p(r+1)), p(r) = rowbase[r >> 6] + rowoff[r]; per slot a code
// byte and a value slot (float32, or float16 times the row's float32 scale).
// Code c <= 253: the running column advances by c and the slot is an element;
// code 255: the column advances by the value slot's bits (unsigned 32- or
// 16-bit), code 254: by those bits << 16; markers hold no element. The
// running column starts at 0 in every row. Every array is rebased so that
// p(0) = 0 (the Python side checks).
//
// A group of L lanes (L = 4, 8, 16, 32) takes one row; one "trip" decodes L
// consecutive slots, one per lane: the lanes load their code and value
// (coalesced), form their deltas, and an inclusive prefix sum over the group
// (__shfl_up_sync) plus the running column of the previous trip gives every
// lane its column. Trip counts are made uniform over the warp (the warp's
// longest row), so the full-mask shuffles are always legal.
//
// Kernels (extern "C"; <L> = 4, 8, 16, 32):
//   cmp_spmv_<L>, cmp16_spmv_<L>     y = A x (float32 / float16 values); also the
//                                    back projection on a stored compressed A^T.
//                                    Epilogue `mode` as spmv.cu (0 plain, 1 g/fp,
//                                    2 f*bp/norm). Deterministic (no atomics).
//   scatter_cmp_<L>, scatter_cmp16_<L>          out += A^T c from the rows of A,
//                                    float atomicAdd. NOT deterministic.
//   scatter_det_cmp_<L>, scatter_det_cmp16_<L>  the same into 64-bit fixed point
//                                    (acc); deterministic.
//   onepass_csr_<L>, onepass_cmp_<L>, onepass_cmp16_<L>
//                                    one-pass MLEM step: per row fp = a_i . f,
//                                    c = g_i / fp (0 where fp == 0), bp += c a_i
//                                    with float atomicAdd. NOT deterministic.
//   onepass_det_csr_<L>, onepass_det_cmp_<L>, onepass_det_cmp16_<L>
//                                    the same, bp accumulated in 64-bit fixed point
//                                    (acc): deterministic.
//   fixed_to_float                   out = acc / scale (float32).
//
// One-pass: the L lanes keep the first MLEM_OP_CACHE trips of their row
// (MLEM_OP_CACHE * L slots: columns and values) in registers between the dot
// product and the scatter; a longer row's tail is decoded again.
//
// Fixed point (the _det kernels): each term t = v * c (float32, >= 0) is added
// as the unsigned 64-bit integer rint(t * scale) with an integer atomicAdd:
// integer sums do not depend on the order, so the result is bit-identical run
// after run (and across GPUs when their partial sums are added as integers).
// `scale` is a power of two chosen by the caller from an upper bound B of every
// output (scale * B <= 2^62); each term is off by at most 0.5 / scale, so an
// output of K terms is off by at most K / (2 scale) <= K * B * 2^-63 before the
// final float32 rounding. A term that does not fit (t * scale >= 2^64, NaN) sets
// bit 0 of *flag, an addition that wraps sets bit 1: the caller then retries
// with a larger bound.
//
// Row pointer: CSR indptr is int64 (m+1); the compressed rowbase is int64 and
// rowoff uint32. Slot and element offsets are 64-bit throughout.

typedef long long i64;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define ROW_SHIFT 6

// Threads per block the kernels are built for (the launcher's THREADS).
#ifndef MLEM_CMP_THREADS
#define MLEM_CMP_THREADS 256
#endif

#ifndef MLEM_OP_CACHE
#define MLEM_OP_CACHE 16
#endif

#define FMT_CSR 0
#define FMT_CMP 1
#define FMT_CMP16 2

#define MODE_PLAIN 0
#define MODE_CORR 1
#define MODE_UPDATE 2

// The epilogue of spmv.cu, spelled the same (y and aux0 may alias).
__device__ __forceinline__ void write_row(int mode, i64 r, float sum, float* y, const float* aux0,
                                          const float* aux1) {
    float out;
    if (mode == MODE_CORR) {
        out = (sum != 0.0f) ? aux0[r] / sum : 0.0f;
    } else if (mode == MODE_UPDATE) {
        const float nrm = aux1[r];
        out = (nrm != 0.0f) ? aux0[r] * sum / nrm : aux0[r] * sum;
    } else {
        out = sum;
    }
    y[r] = out;
}

// IEEE binary16 bits -> float32 (exact), without cuda_fp16.h.
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ i64 warp_max(i64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const i64 u = __shfl_xor_sync(FULL_MASK, v, o);
        v = u > v ? u : v;
    }
    return v;
}

// First slot (element for CSR) of row r.
template <int FMT>
__device__ __forceinline__ i64 row_start(const i64* __restrict__ rp, const unsigned* __restrict__ roff, i64 r) {
    if (FMT == FMT_CSR) return rp[r];
    return rp[r >> ROW_SHIFT] + (i64)roff[r];
}

// One trip of the L lanes of a group over slots [k0, k0 + L) of a row ending at
// e: lane `lane` takes slot k0 + lane. Returns true when the lane holds an
// element (column `col`, value `v`). `carry` is the running column before k0 on
// entry and after the trip on return (the same in every lane of the group).
// Must be called by all 32 lanes of the warp together (shuffles).
template <int L, int FMT>
__device__ __forceinline__ bool trip(i64 k0, i64 e, int lane, const void* __restrict__ idx,
                                     const void* __restrict__ val, float rs, unsigned& carry,
                                     unsigned& col, float& v) {
    const i64 k = k0 + lane;
    const bool in = k < e;
    if (FMT == FMT_CSR) {
        col = in ? (unsigned)__ldg((const int*)idx + k) : 0u;
        v = in ? __ldg((const float*)val + k) : 0.0f;
        return in;
    }
    unsigned code = 254u;  // lanes past the row's end: no element, delta 0
    unsigned d = 0u;
    v = 0.0f;
    if (in) {
        code = (unsigned)__ldg((const unsigned char*)idx + k);
        if (FMT == FMT_CMP) {
            const unsigned bits = __ldg((const unsigned*)val + k);
            if (code < 254u) {
                d = code;
                v = __uint_as_float(bits);
            } else {
                d = (code == 254u) ? (bits << 16) : bits;
            }
        } else {
            const unsigned short h = __ldg((const unsigned short*)val + k);
            if (code < 254u) {
                d = code;
                v = half_bits_to_float(h) * rs;
            } else {
                d = (code == 254u) ? ((unsigned)h << 16) : (unsigned)h;
            }
        }
    }
#pragma unroll
    for (int o = 1; o < L; o <<= 1) {
        const unsigned u = __shfl_up_sync(FULL_MASK, d, o, L);
        if (lane >= o) d += u;
    }
    col = carry + d;
    carry = __shfl_sync(FULL_MASK, col, L - 1, L);
    return in && code < 254u;
}

// bp[j] += t (float atomic) or acc[j] += rint(t * fscale) (fixed point).
template <bool DET>
__device__ __forceinline__ void add_term(float* bp, u64* acc, unsigned j, float t, double fscale, int* flag) {
    if (DET) {
        const double q = (double)t * fscale;
        if (!(q >= 0.0 && q < 18446744073709551616.0)) {
            atomicOr(flag, 1);
            return;
        }
        const u64 u = __double2ull_rn(q);
        if (u != 0ull) {
            const u64 old = atomicAdd(acc + j, u);
            if (old + u < old) atomicOr(flag, 2);
        }
    } else {
        atomicAdd(bp + j, t);
    }
}

// ---------------------------------------------------------------------------
// y = A x, one group of L lanes per row, grid-stride over warp-aligned rows.
template <int L, int FMT>
__device__ __forceinline__ void spmv_body(const i64* __restrict__ rp, const unsigned* __restrict__ roff,
                                          const void* __restrict__ idx, const void* __restrict__ val,
                                          const float* __restrict__ scale, const float* __restrict__ x,
                                          float* y, i64 m, int mode, const float* aux0, const float* aux1) {
    const int lane = threadIdx.x & (L - 1);
    const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 ngroups = ((i64)gridDim.x * blockDim.x) / L;
    for (i64 r = gtid / L; r - (i64)((threadIdx.x & 31) / L) < m; r += ngroups) {
        const bool valid = r < m;
        i64 s = 0, e = 0;
        float rs = 1.0f;
        if (valid) {
            s = row_start<FMT>(rp, roff, r);
            e = row_start<FMT>(rp, roff, r + 1);
            if (FMT == FMT_CMP16) rs = __ldg(scale + r);
        }
        const i64 trips = warp_max((e - s + L - 1) / L);
        float sum = 0.0f;
        unsigned carry = 0u;
        for (i64 t = 0; t < trips; ++t) {
            unsigned col;
            float v;
            if (trip<L, FMT>(s + t * L, e, lane, idx, val, rs, carry, col, v)) sum += v * __ldg(x + col);
        }
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off, L);
        if (valid && lane == 0) write_row(mode, r, sum, y, aux0, aux1);
    }
}

// out += A^T c from the rows of A (rows with c_r == 0 are skipped).
template <int L, int FMT, bool DET>
__device__ __forceinline__ void scatter_body(const i64* __restrict__ rp, const unsigned* __restrict__ roff,
                                             const void* __restrict__ idx, const void* __restrict__ val,
                                             const float* __restrict__ scale, const float* __restrict__ c,
                                             float* out, u64* acc, double fscale, int* flag, i64 m) {
    const int lane = threadIdx.x & (L - 1);
    const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 ngroups = ((i64)gridDim.x * blockDim.x) / L;
    for (i64 r = gtid / L; r - (i64)((threadIdx.x & 31) / L) < m; r += ngroups) {
        const bool valid = r < m;
        i64 s = 0, e = 0;
        float rs = 1.0f, cr = 0.0f;
        if (valid) cr = __ldg(c + r);
        if (cr != 0.0f) {
            s = row_start<FMT>(rp, roff, r);
            e = row_start<FMT>(rp, roff, r + 1);
            if (FMT == FMT_CMP16) rs = __ldg(scale + r);
        }
        const i64 trips = warp_max((e - s + L - 1) / L);
        unsigned carry = 0u;
        for (i64 t = 0; t < trips; ++t) {
            unsigned col;
            float v;
            if (trip<L, FMT>(s + t * L, e, lane, idx, val, rs, carry, col, v) && v != 0.0f)
                add_term<DET>(out, acc, col, v * cr, fscale, flag);
        }
    }
}

// One-pass MLEM step: fp_r = a_r . f, c_r = g_r / fp_r (0 where fp_r == 0),
// bp += c_r a_r. fp (length m) receives fp_r.
template <int L, int FMT, bool DET>
__device__ __forceinline__ void onepass_body(const i64* __restrict__ rp, const unsigned* __restrict__ roff,
                                             const void* __restrict__ idx, const void* __restrict__ val,
                                             const float* __restrict__ scale, const float* __restrict__ f,
                                             const float* __restrict__ g, float* fp, float* bp, u64* acc,
                                             double fscale, int* flag, i64 m) {
    const int lane = threadIdx.x & (L - 1);
    const i64 gtid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 ngroups = ((i64)gridDim.x * blockDim.x) / L;
    for (i64 r = gtid / L; r - (i64)((threadIdx.x & 31) / L) < m; r += ngroups) {
        const bool valid = r < m;
        i64 s = 0, e = 0;
        float rs = 1.0f;
        if (valid) {
            s = row_start<FMT>(rp, roff, r);
            e = row_start<FMT>(rp, roff, r + 1);
            if (FMT == FMT_CMP16) rs = __ldg(scale + r);
        }
        const i64 trips = warp_max((e - s + L - 1) / L);
        // dot product; the first MLEM_OP_CACHE trips stay in registers
        float cv[MLEM_OP_CACHE];
        unsigned cc[MLEM_OP_CACHE];
        float sum = 0.0f;
        unsigned carry = 0u;
#pragma unroll
        for (int t = 0; t < MLEM_OP_CACHE; ++t) {
            cv[t] = 0.0f;
            cc[t] = 0u;
            if (t < trips) {
                unsigned col;
                float v;
                if (trip<L, FMT>(s + (i64)t * L, e, lane, idx, val, rs, carry, col, v)) {
                    sum += v * __ldg(f + col);
                    cv[t] = v;
                    cc[t] = col;
                }
            }
        }
        const unsigned carry_cached = carry;
        for (i64 t = MLEM_OP_CACHE; t < trips; ++t) {
            unsigned col;
            float v;
            if (trip<L, FMT>(s + t * L, e, lane, idx, val, rs, carry, col, v)) sum += v * __ldg(f + col);
        }
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off, L);
        float ci = 0.0f;
        if (valid) {
            if (sum != 0.0f) ci = __ldg(g + r) / sum;
            if (lane == 0) fp[r] = sum;
        }
        // scatter: cached trips from registers, the tail decoded again
        if (ci != 0.0f) {
#pragma unroll
            for (int t = 0; t < MLEM_OP_CACHE; ++t) {
                if (cv[t] != 0.0f) add_term<DET>(bp, acc, cc[t], cv[t] * ci, fscale, flag);
            }
        }
        if (trips > MLEM_OP_CACHE) {  // warp-uniform
            carry = carry_cached;
            for (i64 t = MLEM_OP_CACHE; t < trips; ++t) {
                unsigned col;
                float v;
                if (trip<L, FMT>(s + t * L, e, lane, idx, val, rs, carry, col, v) && ci != 0.0f && v != 0.0f)
                    add_term<DET>(bp, acc, col, v * ci, fscale, flag);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Entry points. Every kernel takes the matrix as (rp, roff, idx, val, scale):
//   CSR:           rp = indptr (int64), roff unused, idx = indices (int32), val = data (float32), scale unused
//   compressed:    rp = rowbase (int64), roff = rowoff (uint32), idx = codes (uint8), val = values (float32 bits)
//   compressed16:  the same with val = values (float16 bits) and scale = row scales (float32)
// Unused pointers may be any device array.

#define SPMV_KERNEL(NAME, L, FMT)                                                                          \
    extern "C" __global__ void __launch_bounds__(MLEM_CMP_THREADS) NAME##_##L(                                          \
        const i64* rp, const unsigned* roff, const void* idx, const void* val, const float* scale,          \
        const float* x, float* y, i64 m, int mode, const float* aux0, const float* aux1) {                 \
        spmv_body<L, FMT>(rp, roff, idx, val, scale, x, y, m, mode, aux0, aux1);                           \
    }

#define SCATTER_KERNELS(NAME, L, FMT)                                                                      \
    extern "C" __global__ void __launch_bounds__(MLEM_CMP_THREADS) scatter_##NAME##_##L(                                \
        const i64* rp, const unsigned* roff, const void* idx, const void* val, const float* scale,          \
        const float* c, float* out, i64 m) {                                                               \
        scatter_body<L, FMT, false>(rp, roff, idx, val, scale, c, out, nullptr, 0.0, nullptr, m);          \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(MLEM_CMP_THREADS) scatter_det_##NAME##_##L(                            \
        const i64* rp, const unsigned* roff, const void* idx, const void* val, const float* scale,          \
        const float* c, u64* acc, double fscale, int* flag, i64 m) {                                       \
        scatter_body<L, FMT, true>(rp, roff, idx, val, scale, c, nullptr, acc, fscale, flag, m);           \
    }

#define ONEPASS_KERNELS(NAME, L, FMT)                                                                      \
    extern "C" __global__ void __launch_bounds__(MLEM_CMP_THREADS) onepass_##NAME##_##L(                                \
        const i64* rp, const unsigned* roff, const void* idx, const void* val, const float* scale,          \
        const float* f, const float* g, float* fp, float* bp, i64 m) {                                     \
        onepass_body<L, FMT, false>(rp, roff, idx, val, scale, f, g, fp, bp, nullptr, 0.0, nullptr, m);    \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(MLEM_CMP_THREADS) onepass_det_##NAME##_##L(                            \
        const i64* rp, const unsigned* roff, const void* idx, const void* val, const float* scale,          \
        const float* f, const float* g, float* fp, u64* acc, double fscale, int* flag, i64 m) {            \
        onepass_body<L, FMT, true>(rp, roff, idx, val, scale, f, g, fp, nullptr, acc, fscale, flag, m);    \
    }

#define ALL_LANES(L)                          \
    SPMV_KERNEL(cmp_spmv, L, FMT_CMP)         \
    SPMV_KERNEL(cmp16_spmv, L, FMT_CMP16)     \
    SCATTER_KERNELS(cmp, L, FMT_CMP)          \
    SCATTER_KERNELS(cmp16, L, FMT_CMP16)      \
    ONEPASS_KERNELS(csr, L, FMT_CSR)          \
    ONEPASS_KERNELS(cmp, L, FMT_CMP)          \
    ONEPASS_KERNELS(cmp16, L, FMT_CMP16)

ALL_LANES(4)
ALL_LANES(8)
ALL_LANES(16)
ALL_LANES(32)

// out[j] = acc[j] / scale, as float32 (inv_scale = 1 / scale, a power of two).
extern "C" __global__ void fixed_to_float(const u64* __restrict__ acc, float* __restrict__ out, i64 n,
                                          double inv_scale) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        out[j] = (float)((double)acc[j] * inv_scale);
}
