// Probe kernels of tools/device_onepass.py: variants of the atomic scatter and of the
// one-pass iteration, appended to mlemlib/kernels/compressed.cu (whose helpers they use).
// Not part of the library: what measures best moves into compressed.cu / spmv.cu.
//
//   pscat_csr_<A>        the thesis's back projection without A^T: one warp per row,
//                        one element per lane per trip, atomicAdd; no grid-stride loop.
//   pop_csr_<A>_<C>      one-pass step on CSR, C trips of the row in registers
//                        (pop_csrl_: __ldg loads; pop_csrd_: 64-bit fixed point).
// The compressed variants measured in docs/benchmarks.md section 31 (pop_cmp_<A>_<C>: scalar
// atomics per lane, or the trip's slots through shared memory, now the library's) are in
// this file as of commit b2ea669.
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
    }
POP(0, 0)
POP(0, 8)
POP(0, 12)
POP(0, 16)
POP(0, 20)
POP(1, 0)
POP(1, 8)

// ---------------------------------------------------------------------------
// pchunk_onepass_<f32|det>: the one pass through a mlemlib.chunked.ChunkPlan (not yet
// measured). One block per chunk: f at the chunk's voxels staged in shared memory, a warp
// per row (dot product from shared memory, then the row's terms added into the chunk's
// shared-memory sums at the 16-bit local indices), then one global atomic per distinct
// voxel of the chunk. det: the sums are 64-bit fixed point in shared and global memory
// (order-independent: deterministic). Dynamic shared memory: window floats of f, then
// window float (f32) or uint64 (det) sums; `window` even.
template <bool DET>
__device__ __forceinline__ void pchunk_body(const i64* __restrict__ chunk_rows, const i64* __restrict__ vptr,
                                            const int* __restrict__ voxels, const i64* __restrict__ rp,
                                            const unsigned short* __restrict__ local,
                                            const float* __restrict__ val, const float* __restrict__ f,
                                            const float* __restrict__ g, float* fp, float* bp, u64* acc,
                                            double fscale, int* flag, int window) {
    extern __shared__ float sm[];
    float* fl = sm;
    float* af = sm + window;
    u64* au = reinterpret_cast<u64*>(sm + window);
    const i64 c = blockIdx.x;
    const i64 v0 = vptr[c];
    const int nv = (int)(vptr[c + 1] - v0);
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        fl[i] = __ldg(f + __ldg(voxels + v0 + i));
        if (DET) au[i] = 0ull; else af[i] = 0.0f;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int nw = blockDim.x >> 5;
    const i64 r1 = chunk_rows[c + 1];
    for (i64 r = chunk_rows[c] + (threadIdx.x >> 5); r < r1; r += nw) {  // warp-uniform
        const i64 s = rp[r], e = rp[r + 1];
        float sum = 0.0f;
        for (i64 k = s + lane; k < e; k += 32) sum += __ldg(val + k) * fl[__ldg(local + k)];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
        const float ci = sum != 0.0f ? __ldg(g + r) / sum : 0.0f;
        if (lane == 0) fp[r] = sum;
        if (ci == 0.0f) continue;  // warp-uniform
        for (i64 k = s + lane; k < e; k += 32) {
            const unsigned j = __ldcs(local + k);
            const float t = __ldcs(val + k) * ci;
            if (DET) {
                const double q = (double)t * fscale;
                if (!(q >= 0.0 && q < 18446744073709551616.0)) {
                    atomicOr(flag, 1);
                } else {
                    atomicAdd(au + j, __double2ull_rn(q));
                }
            } else {
                atomicAdd(af + j, t);
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        const int col = __ldg(voxels + v0 + i);
        if (DET) {
            const u64 u = au[i];
            if (u != 0ull) {
                const u64 old = atomicAdd(acc + col, u);
                if (old + u < old) atomicOr(flag, 2);
            }
        } else if (af[i] != 0.0f) {
            atomicAdd(bp + col, af[i]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(PROBE_THREADS) pchunk_onepass_f32(
    const i64* chunk_rows, const i64* vptr, const int* voxels, const i64* rp, const unsigned short* local,
    const float* val, const float* f, const float* g, float* fp, float* bp, int window) {
    pchunk_body<false>(chunk_rows, vptr, voxels, rp, local, val, f, g, fp, bp, nullptr, 0.0, nullptr, window);
}

extern "C" __global__ void __launch_bounds__(PROBE_THREADS) pchunk_onepass_det(
    const i64* chunk_rows, const i64* vptr, const int* voxels, const i64* rp, const unsigned short* local,
    const float* val, const float* f, const float* g, float* fp, u64* acc, double fscale, int* flag, int window) {
    pchunk_body<true>(chunk_rows, vptr, voxels, rp, local, val, f, g, fp, nullptr, acc, fscale, flag, window);
}

// pchunk2_onepass_<C>: the library's first chunked one pass (compressed.cu's chunked_onepass_body
// until the rows were interleaved for vector loads): rows in order, one element per lane per
// trip, C trips kept in registers; reads the plain layout of mlemlib.chunked.build_plan.
template <int C>
__device__ __forceinline__ void plain_chunk_body(const i64* __restrict__ chunk_rows,
                                                     const i64* __restrict__ vptr, const int* __restrict__ voxels,
                                                     const i64* __restrict__ rp,
                                                     const unsigned short* __restrict__ local,
                                                     const float* __restrict__ val, const float* __restrict__ f,
                                                     const float* __restrict__ g, float* fp, u64* acc,
                                                     double fscale, int* flag, int window, int fwd_only) {
    extern __shared__ float chunk_sm[];
    float* fl = chunk_sm;
    unsigned* lo = reinterpret_cast<unsigned*>(chunk_sm + window);
    unsigned* hi = lo + window;
    const i64 c = blockIdx.x;
    const i64 v0 = vptr[c];
    const int nv = (int)(vptr[c + 1] - v0);
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        fl[i] = __ldg(f + __ldg(voxels + v0 + i));
        lo[i] = 0u;
        hi[i] = 0u;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int nw = blockDim.x >> 5;
    const i64 r1 = chunk_rows[c + 1];
    int bad = 0;
    for (i64 r = chunk_rows[c] + (threadIdx.x >> 5); r < r1; r += nw) {  // warp-uniform
        const i64 s = rp[r], e = rp[r + 1];
        unsigned cc[C > 0 ? C : 1];
        float cv[C > 0 ? C : 1];
#pragma unroll
        for (int t = 0; t < C; ++t) {
            const i64 k = s + 32 * t + lane;
            cc[t] = 0u;
            cv[t] = 0.0f;
            if (k < e) {
                cc[t] = __ldcs(local + k);
                cv[t] = __ldcs(val + k);
            }
        }
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < C; ++t) sum += cv[t] * fl[cc[t]];
        for (i64 k = s + 32 * C + lane; k < e; k += 32) sum += __ldg(val + k) * fl[__ldg(local + k)];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
        if (lane == 0) fp[r] = sum;
        const float ci = (sum != 0.0f && !fwd_only) ? __ldg(g + r) / sum : 0.0f;
        if (ci == 0.0f) continue;  // warp-uniform
#pragma unroll
        for (int t = 0; t < C; ++t) {
            if (s + 32 * t >= e) break;  // warp-uniform
            chunk_put(lo, hi, cc[t], cv[t] * ci, fscale, bad);  // compressed.cu's split fixed-point add
        }
        for (i64 k = s + 32 * C + lane; k < e; k += 32) chunk_put(lo, hi, __ldcs(local + k), __ldcs(val + k) * ci, fscale, bad);
    }
    if (bad) atomicOr(flag, 1);
    if (fwd_only) return;  // uniform over the block
    __syncthreads();
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        const u64 u = ((u64)hi[i] << 20) + (u64)lo[i];
        if (u != 0ull) {
            const u64 old = atomicAdd(acc + __ldg(voxels + v0 + i), u);
            if (old + u < old) atomicOr(flag, 2);
        }
    }
}

#define PCHUNK2(C)                                                                                              \
    extern "C" __global__ void __launch_bounds__(PROBE_THREADS) pchunk2_onepass_##C(                          \
        const i64* chunk_rows, const i64* vptr, const int* voxels, const i64* rp, const unsigned short* local, \
        const float* val, const float* f, const float* g, float* fp, u64* acc, double fscale, int* flag,     \
        int window) {                                                                                          \
        plain_chunk_body<C>(chunk_rows, vptr, voxels, rp, local, val, f, g, fp, acc, fscale, flag, window, 0);     \
    }
PCHUNK2(0)
PCHUNK2(8)
PCHUNK2(16)
