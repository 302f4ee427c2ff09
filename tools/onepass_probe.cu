// Probe kernels of tools/device_onepass.py: variants of the atomic scatter and of the
// one-pass iteration, appended to mlemlib/kernels/compressed.cu (whose helpers they use).
// Not part of the library: what measures best moves into compressed.cu / spmv.cu.
//
//   pscat_csr_<A>        the thesis's back projection without A^T: one warp per row,
//                        one element per lane per trip, atomicAdd; no grid-stride loop.
//   pop_csr_<A>_<C>      one-pass step on CSR, C trips of the row in registers.
//   pop_cmp_<A>_<C>      one-pass step on the compressed f32c8 format (4 slots per lane).
// <A>: 0 = one float atomic per element; 1 = warp-aggregated: the elements of an aligned
// group of 4 voxels are combined and added with one 16-byte vector atomic (sm_90), a
// group holding one element with a scalar atomic.

#ifndef PROBE_THREADS
#define PROBE_THREADS 1024
#endif

// Scalar or 16-byte vector atomic of the 4-voxel group b (slot mask `msk`, values t0..t3).
__device__ __forceinline__ void put_group(float* out, unsigned b, unsigned msk, float t0, float t1, float t2,
                                          float t3) {
    if (__popc(msk) == 1) {
        const int s = __ffs(msk) - 1;
        const float t = s == 0 ? t0 : s == 1 ? t1 : s == 2 ? t2 : t3;
        atomicAdd(out + 4 * b + s, t);
    } else {
#if __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(out + 4 * b), make_float4(t0, t1, t2, t3));
#else
        if (msk & 1) atomicAdd(out + 4 * b, t0);
        if (msk & 2) atomicAdd(out + 4 * b + 1, t1);
        if (msk & 4) atomicAdd(out + 4 * b + 2, t2);
        if (msk & 8) atomicAdd(out + 4 * b + 3, t3);
#endif
    }
}

// All 32 lanes call; lane holds element (col, t) when `has`; the lanes' columns increase
// with the lane number (one row per warp). The first lane of each aligned group of 4
// voxels adds the group's elements (at most 4 consecutive lanes) with one atomic.
template <int AGG>
__device__ __forceinline__ void warp_add(float* out, bool has, unsigned col, float t, int lane) {
    if (AGG == 0) {
        if (has) atomicAdd(out + col, t);
        return;
    }
    const unsigned b = has ? (col >> 2) : (0xffffffffu - (unsigned)lane);
    const unsigned prev = __shfl_up_sync(FULL_MASK, b, 1);
    const bool leader = has && (lane == 0 || prev != b);
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    unsigned msk = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const unsigned bk = __shfl_down_sync(FULL_MASK, b, k);
        const unsigned ck = __shfl_down_sync(FULL_MASK, col, k);
        const float tk = __shfl_down_sync(FULL_MASK, t, k);
        if (lane + k < 32 && bk == b) {
            const unsigned s = ck & 3u;
            msk |= 1u << s;
            v[0] += s == 0 ? tk : 0.0f;
            v[1] += s == 1 ? tk : 0.0f;
            v[2] += s == 2 ? tk : 0.0f;
            v[3] += s == 3 ? tk : 0.0f;
        }
    }
    if (leader) put_group(out, b, msk, v[0], v[1], v[2], v[3]);
}

// A lane's own run of up to 4 elements with increasing columns (compressed: one quad),
// added in aligned groups of 4 voxels.
template <int AGG>
__device__ __forceinline__ void lane_add(float* out, const unsigned col[4], const float t[4], const bool el[4]) {
    if (AGG == 0) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (el[k]) atomicAdd(out + col[k], t[k]);
        return;
    }
    unsigned cur = 0xffffffffu, msk = 0u;
    float v0 = 0.0f, v1 = 0.0f, v2 = 0.0f, v3 = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if (!el[k]) continue;
        const unsigned b = col[k] >> 2, s = col[k] & 3u;
        if (b != cur) {
            if (msk) put_group(out, cur, msk, v0, v1, v2, v3);
            cur = b;
            msk = 0u;
            v0 = v1 = v2 = v3 = 0.0f;
        }
        msk |= 1u << s;
        v0 += s == 0 ? t[k] : 0.0f;
        v1 += s == 1 ? t[k] : 0.0f;
        v2 += s == 2 ? t[k] : 0.0f;
        v3 += s == 3 ? t[k] : 0.0f;
    }
    if (msk) put_group(out, cur, msk, v0, v1, v2, v3);
}

template <int AGG>
__device__ __forceinline__ void pscat_body(const i64* __restrict__ rp, const int* __restrict__ idx,
                                           const float* __restrict__ val, const float* __restrict__ c, float* out,
                                           i64 m) {
    const int lane = threadIdx.x & 31;
    const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (r >= m) return;  // warp-uniform
    const float cr = __ldg(c + r);
    if (cr == 0.0f) return;
    const i64 s = rp[r], e = rp[r + 1];
    for (i64 k0 = s; k0 < e; k0 += 32) {
        const i64 k = k0 + lane;
        const bool has = k < e;
        const unsigned col = has ? (unsigned)__ldcs(idx + k) : 0u;
        const float t = has ? __ldcs(val + k) * cr : 0.0f;
        warp_add<AGG>(out, has, col, t, lane);
    }
}

template <bool STREAM>
__device__ __forceinline__ unsigned ld_col(const int* p) {
    return STREAM ? (unsigned)__ldcs(p) : (unsigned)__ldg(p);
}
template <bool STREAM>
__device__ __forceinline__ float ld_val(const float* p) {
    return STREAM ? __ldcs(p) : __ldg(p);
}

// DET: 64-bit fixed point (add_term of compressed.cu); STREAM: streaming loads of the matrix.
template <int AGG, int C, bool DET, bool STREAM>
__device__ __forceinline__ void pop_csr_body(const i64* __restrict__ rp, const int* __restrict__ idx,
                                             const float* __restrict__ val, const float* __restrict__ f,
                                             const float* __restrict__ g, float* fp, float* bp, u64* acc,
                                             double fscale, int* flag, i64 m) {
    const int lane = threadIdx.x & 31;
    const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (r >= m) return;  // warp-uniform
    const i64 s = rp[r], e = rp[r + 1];
    unsigned cc[C > 0 ? C : 1];
    float cv[C > 0 ? C : 1];
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < C; ++t) {
        const i64 k = s + 32 * t + lane;
        cc[t] = 0u;
        cv[t] = 0.0f;
        if (k < e) {
            cc[t] = ld_col<STREAM>(idx + k);
            cv[t] = ld_val<STREAM>(val + k);
            sum += cv[t] * __ldg(f + cc[t]);
        }
    }
    for (i64 k = s + 32 * C + lane; k < e; k += 32) sum += __ldg(val + k) * __ldg(f + __ldg(idx + k));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
    const float ci = sum != 0.0f ? __ldg(g + r) / sum : 0.0f;
    if (lane == 0) fp[r] = sum;
    if (ci == 0.0f) return;  // warp-uniform
#pragma unroll
    for (int t = 0; t < C; ++t) {
        if (s + 32 * t >= e) break;  // warp-uniform
        if (DET) {
            if (cv[t] != 0.0f) add_term<true>(bp, acc, cc[t], cv[t] * ci, fscale, flag);
        } else {
            warp_add<AGG>(bp, s + 32 * t + lane < e, cc[t], cv[t] * ci, lane);
        }
    }
    for (i64 k0 = s + 32 * C; k0 < e; k0 += 32) {
        const i64 k = k0 + lane;
        const bool has = k < e;
        const unsigned col = has ? ld_col<STREAM>(idx + k) : 0u;
        const float t = has ? ld_val<STREAM>(val + k) * ci : 0.0f;
        if (DET) {
            if (has && t != 0.0f) add_term<true>(bp, acc, col, t, fscale, flag);
        } else {
            warp_add<AGG>(bp, has, col, t, lane);
        }
    }
}

// f32c8 compressed (8-bit codes, float32 values), 32 lanes, 4 slots per lane per trip.
// AGG 2: the warp's 128 slots of a trip go through shared memory so that atomic k of
// lane l adds slot 32 k + l (consecutive slots per instruction, as in CSR).
__device__ __forceinline__ void warp_t_add(float* out, const unsigned col[4], const float t[4], const bool el[4],
                                           int lane) {
    __shared__ unsigned scol[PROBE_THREADS / 32][128];
    __shared__ float sval[PROBE_THREADS / 32][128];
    const int w = threadIdx.x >> 5;
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        scol[w][4 * lane + k] = col[k];
        sval[w][4 * lane + k] = el[k] ? t[k] : 0.0f;
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float v = sval[w][32 * k + lane];
        if (v != 0.0f) atomicAdd(out + scol[w][32 * k + lane], v);
    }
}

template <int AGG, int C>
__device__ __forceinline__ void pop_cmp_body(const i64* __restrict__ rb, const unsigned* __restrict__ ro,
                                             const void* __restrict__ codes, const void* __restrict__ vals,
                                             const float* __restrict__ f, const float* __restrict__ g, float* fp,
                                             float* bp, i64 m) {
    const int lane = threadIdx.x & 31;
    const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (r >= m) return;  // warp-uniform
    const i64 qs = cstart(rb, ro, r) >> 2, qe = cstart(rb, ro, r + 1) >> 2;
    const i64 trips = (qe - qs + 31) / 32;
    unsigned cc[4 * (C > 0 ? C : 1)];
    float cv[4 * (C > 0 ? C : 1)];
    float sum = 0.0f;
    unsigned carry = 0u;
#pragma unroll
    for (int t = 0; t < C; ++t) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            cc[4 * t + k] = 0u;
            cv[4 * t + k] = 0.0f;
        }
        if (t < trips) {
            const i64 q = qs + 32 * t + lane;
            unsigned d[4];
            float v[4];
            bool el[4];
            const unsigned tot = load_quad<32, 8>(codes, vals, 1.0f, q, q < qe, d, v, el);
            unsigned all;
            unsigned col = carry + group_excl_scan<32>(tot, lane, all);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                col += d[k];
                if (el[k]) {
                    sum += v[k] * __ldg(f + col);
                    cc[4 * t + k] = col;
                    cv[4 * t + k] = v[k];
                }
            }
            carry += all;
        }
    }
    const unsigned carry_cached = carry;
    for (i64 t = C; t < trips; ++t) {
        const i64 q = qs + 32 * t + lane;
        unsigned d[4];
        float v[4];
        bool el[4];
        const unsigned tot = load_quad<32, 8>(codes, vals, 1.0f, q, q < qe, d, v, el);
        unsigned all;
        unsigned col = carry + group_excl_scan<32>(tot, lane, all);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            col += d[k];
            if (el[k]) sum += v[k] * __ldg(f + col);
        }
        carry += all;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
    const float ci = sum != 0.0f ? __ldg(g + r) / sum : 0.0f;
    if (lane == 0) fp[r] = sum;
    if (ci == 0.0f) return;  // warp-uniform
#pragma unroll
    for (int t = 0; t < C; ++t) {
        unsigned col[4];
        float tv[4];
        bool el[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            col[k] = cc[4 * t + k];
            tv[k] = cv[4 * t + k] * ci;
            el[k] = cv[4 * t + k] != 0.0f;
        }
        if (AGG == 2) {
            warp_t_add(bp, col, tv, el, lane);
        } else {
            lane_add<AGG>(bp, col, tv, el);
        }
    }
    carry = carry_cached;
    for (i64 t = C; t < trips; ++t) {
        const i64 q = qs + 32 * t + lane;
        unsigned d[4];
        float v[4];
        bool el[4];
        const unsigned tot = load_quad<32, 8>(codes, vals, 1.0f, q, q < qe, d, v, el);
        unsigned all;
        unsigned col = carry + group_excl_scan<32>(tot, lane, all);
        unsigned cl[4];
        float tv[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            col += d[k];
            cl[k] = col;
            tv[k] = v[k] * ci;
            el[k] = el[k] && v[k] != 0.0f;
        }
        if (AGG == 2) {
            warp_t_add(bp, cl, tv, el, lane);
        } else {
            lane_add<AGG>(bp, cl, tv, el);
        }
        carry += all;
    }
}

#define PSCAT(A)                                                                                        \
    extern "C" __global__ void __launch_bounds__(PROBE_THREADS) pscat_csr_##A(                          \
        const i64* rp, const int* idx, const float* val, const float* c, float* out, i64 m) {            \
        pscat_body<A>(rp, idx, val, c, out, m);                                                          \
    }
PSCAT(0)
PSCAT(1)

#define POP(A, C)                                                                                       \
    extern "C" __global__ void __launch_bounds__(PROBE_THREADS) pop_csr_##A##_##C(                      \
        const i64* rp, const int* idx, const float* val, const float* f, const float* g, float* fp,      \
        float* bp, i64 m) {                                                                              \
        pop_csr_body<A, C, false, true>(rp, idx, val, f, g, fp, bp, nullptr, 0.0, nullptr, m);           \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(PROBE_THREADS) pop_csrl_##A##_##C(                     \
        const i64* rp, const int* idx, const float* val, const float* f, const float* g, float* fp,      \
        float* bp, i64 m) {                                                                              \
        pop_csr_body<A, C, false, false>(rp, idx, val, f, g, fp, bp, nullptr, 0.0, nullptr, m);          \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(PROBE_THREADS) pop_csrd_##A##_##C(                     \
        const i64* rp, const int* idx, const float* val, const float* f, const float* g, float* fp,      \
        u64* acc, double fscale, int* flag, i64 m) {                                                     \
        pop_csr_body<A, C, true, true>(rp, idx, val, f, g, fp, nullptr, acc, fscale, flag, m);           \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(PROBE_THREADS) pop_cmp_##A##_##C(                      \
        const i64* rb, const unsigned* ro, const void* codes, const void* vals, const float* f,          \
        const float* g, float* fp, float* bp, i64 m) {                                                   \
        pop_cmp_body<A, C>(rb, ro, codes, vals, f, g, fp, bp, m);                                        \
    }
POP(0, 0)
POP(0, 8)
POP(0, 12)
POP(0, 16)
POP(0, 20)
POP(1, 0)
POP(1, 8)
POP(2, 0)
POP(2, 8)
