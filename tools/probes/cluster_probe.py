"""One-off probe (not kept): the chunked one pass with its window spread over a thread-block cluster's
distributed shared memory (CL blocks of 1,024 threads, each holding 16,384 voxels' f and sums; every
non-zero's f read and its two 32-bit adds go to the block that holds its voxel: ld/red.shared::cluster).
One GPU; madpet2 folded and reordered, whole and its 16 angle subsets; the product's chunked_step beside
CL = 1, 2, 4 (windows 16,384, 32,768, 65,536); CUDA events, medians of 20; sums and fp compared bit for bit."""
import hashlib, json, os, sys, time
import cupy as cp
import numpy as np
from mlemlib import chunked
from mlemlib.backends import _compressed_cuda as cc
from mlemlib.backends import _cuda_kernels as ck
from mlemlib.backends._build import kernel_source
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.runner import prepare_case
from mlemlib.formats import open_matrix

EXTRA = r'''
__device__ __forceinline__ unsigned clx_rank() { unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ unsigned clx_id() { unsigned r; asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ void clx_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned clx_map(const void* p, unsigned rank) {
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    unsigned d;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(s), "r"(rank));
    return d;
}
__device__ __forceinline__ float clx_ld(unsigned a) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ void clx_red(unsigned a, unsigned v) {
    asm volatile("red.shared::cluster.add.u32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
}
__device__ __forceinline__ int clx_atom(unsigned a, int v) {
    int o;
    asm volatile("atom.shared::cluster.add.s32 %0, [%1], %2;" : "=r"(o) : "r"(a), "r"(v) : "memory");
    return o;
}
constexpr int CLW = 16384;
template <int CL>
__device__ __forceinline__ unsigned clx_addr(const unsigned (&b)[CL], unsigned j) {
    const unsigned r = j >> 14;
    unsigned a = b[0];
#pragma unroll
    for (int k = 1; k < CL; ++k) a = (r == (unsigned)k) ? b[k] : a;
    return a + ((j & (CLW - 1)) << 2);
}
template <int CL>
__device__ __forceinline__ float clx_dot4(float sum, const unsigned (&b)[CL], ushort4 c, float4 v) {
    sum += v.x * clx_ld(clx_addr<CL>(b, c.x));
    sum += v.y * clx_ld(clx_addr<CL>(b, c.y));
    sum += v.z * clx_ld(clx_addr<CL>(b, c.z));
    sum += v.w * clx_ld(clx_addr<CL>(b, c.w));
    return sum;
}
template <int CL, bool FULL>
__device__ __forceinline__ void clx_put(const unsigned (&b)[CL], unsigned j, float q, unsigned& ovf) {
    const u64 u = __float2ull_rn(q);
    ovf |= (unsigned)(u >> 32);
    if (FULL || q > 0.0f) {
        const unsigned a = clx_addr<CL>(b, j);
        clx_red(a + 4 * CLW, (unsigned)(u & 0xFFFFFull));
        clx_red(a + 8 * CLW, (unsigned)(u >> 20));
    }
}
template <int CL>
__device__ __forceinline__ void clx_put4(const unsigned (&b)[CL], ushort4 c, float4 v, float cs, unsigned& ovf) {
    clx_put<CL, true>(b, c.x, v.x * cs, ovf);
    clx_put<CL, true>(b, c.y, v.y * cs, ovf);
    clx_put<CL, true>(b, c.z, v.z * cs, ovf);
    clx_put<CL, true>(b, c.w, v.w * cs, ovf);
}
template <int CL, int CG>
__device__ __forceinline__ void clx_body(const int* __restrict__ order, const i64* __restrict__ chunk_rows,
    const i64* __restrict__ vptr, const int* __restrict__ voxels, const i64* __restrict__ rp,
    const unsigned short* __restrict__ local, const float* __restrict__ val, const float* __restrict__ f,
    const float* __restrict__ g, float* fp, u64* acc, double fscale, int* flag, u64 red_lim, u64 sum_lim) {
    constexpr int SU = CHUNK_STAGE;
    extern __shared__ float chunk_sm[];
    __shared__ int chunk_next;
    float* fl = chunk_sm;
    unsigned* lo = reinterpret_cast<unsigned*>(chunk_sm + CLW);
    unsigned* hi = lo + CLW;
    const unsigned me = clx_rank();
    const i64 c = order[clx_id()];
    const i64 v0 = vptr[c];
    const int nv = (int)(vptr[c + 1] - v0);
    const i64 r0 = chunk_rows[c];
    const i64 r1 = chunk_rows[c + 1];
    if (nv == 0) {
        if (me == 0)
            for (i64 r = r0 + threadIdx.x; r < r1; r += blockDim.x) fp[r] = 0.0f;
        return;
    }
    unsigned b[CL];
#pragma unroll
    for (int k = 0; k < CL; ++k) b[k] = clx_map(chunk_sm, k);
    const unsigned nxt = clx_map(&chunk_next, 0);
    const int nw = blockDim.x >> 5;
    if (me == 0 && threadIdx.x == 0) chunk_next = CL * nw;
    const int i_lo = (int)me * CLW;
    const int i_hi = min(nv, i_lo + CLW);
    for (int i0 = i_lo + threadIdx.x; i0 < i_hi; i0 += SU * blockDim.x) {
        int vx[SU];
#pragma unroll
        for (int u = 0; u < SU; ++u) {
            const int i = i0 + u * blockDim.x;
            vx[u] = i < i_hi ? __ldg(voxels + v0 + i) : 0;
        }
        float fv[SU];
#pragma unroll
        for (int u = 0; u < SU; ++u) fv[u] = i0 + u * (int)blockDim.x < i_hi ? __ldg(f + vx[u]) : 0.0f;
#pragma unroll
        for (int u = 0; u < SU; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < i_hi) {
                fl[i - i_lo] = fv[u];
                lo[i - i_lo] = 0u;
                hi[i - i_lo] = 0u;
            }
        }
    }
    clx_sync();
    const int lane = threadIdx.x & 31;
    int bad = 0;
    unsigned ovf = 0u;
    const i64 w0 = (i64)me * nw + (threadIdx.x >> 5);
    i64 ps = 0, pe = 0;
    float pg = 0.0f;
    if (r0 + w0 < r1) {
        const i64 r = r0 + w0;
        ps = rp[r];
        pe = rp[r + 1];
        pg = __ldg(g + r);
    }
    for (i64 r = r0 + w0; r < r1;) {
        int nx = 0;
        if (lane == 0) nx = clx_atom(nxt, 1);
        const i64 s = ps, e = pe;
        const float gr = pg;
        const i64 rn = r0 + __shfl_sync(FULL_MASK, nx, 0);
        if (rn < r1) {
            ps = rp[rn];
            pe = rp[rn + 1];
            pg = __ldg(g + rn);
        }
        const int ng = (int)((e - s) >> 7);
        const i64 t0 = s + ((i64)ng << 7);
        const ushort4* __restrict__ lq = reinterpret_cast<const ushort4*>(local + s) + lane;
        const float4* __restrict__ vq = reinterpret_cast<const float4*>(val + s) + lane;
        ushort4 cc[CG];
        float4 cv[CG];
        unsigned rc[4];
        float rv[4];
#pragma unroll
        for (int q = 0; q < CG; ++q) {
            cc[q] = make_ushort4(0, 0, 0, 0);
            cv[q] = make_float4(0.f, 0.f, 0.f, 0.f);
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
                rv[t] = __ldcs(val + k);
            }
        }
        float sum = 0.0f;
#pragma unroll
        for (int q = 0; q < CG; ++q) sum = clx_dot4<CL>(sum, b, cc[q], cv[q]);
#pragma unroll 2
        for (int q = CG; q < ng; ++q) sum = clx_dot4<CL>(sum, b, __ldg(lq + 32 * q), __ldg(vq + 32 * q));
#pragma unroll
        for (int t = 0; t < 4; ++t) sum += rv[t] * clx_ld(clx_addr<CL>(b, rc[t]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
        if (lane == 0) fp[r] = sum;
        const float ci = sum != 0.0f ? gr / sum : 0.0f;
        if (ci != 0.0f) {
            const float cs = ci * (float)fscale;
            if (chunk_fast(cs, fscale)) {
#pragma unroll
                for (int q = 0; q < CG; ++q) {
                    if (q >= ng) break;
                    clx_put4<CL>(b, cc[q], cv[q], cs, ovf);
                }
                for (int q = CG; q < ng; ++q) clx_put4<CL>(b, __ldcs(lq + 32 * q), __ldcs(vq + 32 * q), cs, ovf);
#pragma unroll
                for (int t = 0; t < 4; ++t) clx_put<CL, false>(b, rc[t], rv[t] * cs, ovf);
            } else {
                bad = 1;
            }
        }
        r = rn;
    }
    if (bad || ovf >= (1u << 20)) atomicOr(flag, 1);
    clx_sync();
    for (int i0 = i_lo + threadIdx.x; i0 < i_hi; i0 += SU * blockDim.x) {
        int vx[SU];
        u64 uu[SU];
#pragma unroll
        for (int u = 0; u < SU; ++u) {
            const int i = i0 + u * blockDim.x;
            uu[u] = 0ull;
            vx[u] = 0;
            if (i < i_hi) {
                uu[u] = ((u64)hi[i - i_lo] << 20) + (u64)lo[i - i_lo];
                vx[u] = __ldg(voxels + v0 + i);
            }
        }
        int wrapped = 0;
#pragma unroll
        for (int u = 0; u < SU; ++u) {
            if (uu[u] == 0ull) continue;
            if (uu[u] < red_lim) {
                atomicAdd(acc + vx[u], uu[u]);
            } else {
                const u64 old = atomicAdd(acc + vx[u], uu[u]);
                wrapped |= reaches(uu[u], old, sum_lim);
            }
        }
        if (wrapped) atomicOr(flag, 2);
    }
}
#define CLX(NAME, CL) \
extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(CHUNK_THREADS) NAME( \
    const int* order, const i64* chunk_rows, const i64* vptr, const int* voxels, const i64* rp, \
    const unsigned short* local, const float* val, const float* f, const float* g, float* fp, u64* acc, \
    double fscale, int* flag, u64 red_lim, u64 sum_lim) { \
    clx_body<CL, CHUNK_CACHE>(order, chunk_rows, vptr, voxels, rp, local, val, f, g, fp, acc, fscale, flag, red_lim, sum_lim); }
CLX(clx1, 1)
CLX(clx2, 2)
CLX(clx4, 4)
'''

out = sys.argv[1]
t0 = time.time()
mod = cp.RawModule(code=kernel_source("compressed") + EXTRA, options=("--std=c++17",))
kern = {cl: mod.get_function(f"clx{cl}") for cl in (1, 2, 4)}
for k in kern.values():
    k.max_dynamic_shared_size_bytes = 12 * 16384
print(f"compiled in {time.time() - t0:.1f} s", flush=True)

case = select(load_cases("perf/cases.yaml"), ["madpet2-osem"])[0]
t0 = time.time(); preps = prepare_case(case, "/tmp/bench"); print(f"prepared in {time.time() - t0:.1f} s", flush=True)
sms = ck.device_properties(0)["sm_count"]
print("device", cp.cuda.runtime.getDeviceProperties(0)["name"], "sms", sms, flush=True)
BOUND = 1e6
scale = cc.chunk_scale(BOUND)


def timed(fn, acc, flag, n=25):
    ts = []
    for it in range(n):
        acc.fill(0); flag.fill(0)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(); fn(); e1.record(); e1.synchronize()
        if it >= 5:
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return float(np.median(ts))


rows_out = []
base_cap = chunked.MAX_CHUNK_NNZ
for S in (1, 16):
    prep = [p for p in preps if p.subsets == S][0]
    g, _ = prep.load_problem()
    bnd = np.load(prep.bounds) if S > 1 else None
    for k in range(S):
        rows = (int(bnd[k]), int(bnd[k + 1])) if S > 1 else None
        r0 = rows[0] if rows else 0
        res = {}
        for cl in (1, 2, 4):
            chunked.MAX_CHUNK_NNZ = base_cap * cl
            with open_matrix(str(prep.matrix)) as mat:
                a = cc.DeviceChunked.upload(mat, rows, sms=sms // cl, window=16384 * cl)
            assert not a.half
            sizes = (a.indptr[a.chunk_rows[1:]] - a.indptr[a.chunk_rows[:-1]]).get()
            a.order = cp.asarray(chunked.launch_order(sizes, sms // cl))
            m, n = a.shape
            gg = cp.asarray(g[r0:r0 + m]); f = cp.ones(n, dtype=cp.float32) * 0.7
            fp = cp.empty(m, dtype=cp.float32); acc = cp.zeros(n, dtype=cp.uint64); flag = cp.zeros(1, dtype=cp.int32)
            red, top = cc._limits(a, None)
            if cl == 1:
                t = timed(lambda: cc.chunked_step(a, gg, f, fp=fp, acc=acc, flag=flag, bound=BOUND), acc, flag)
                res["product"] = (t, hashlib.sha256(acc.get().tobytes() + fp.get().tobytes()).hexdigest()[:16], int(flag.get()[0]))
            args = (a.order, a.chunk_rows, a.vptr, a.voxels, a.indptr, a.local, a.data, f, gg, fp, acc,
                    np.float64(scale), flag, red, top)
            t = timed(lambda: kern[cl]((a.chunks * cl,), (1024,), args, shared_mem=12 * 16384), acc, flag)
            res[f"cl{cl}"] = (t, hashlib.sha256(acc.get().tobytes() + fp.get().tobytes()).hexdigest()[:16],
                              int(flag.get()[0]), int(a.chunks), round(a.reuse, 2))
            del a, args
            cp.get_default_memory_pool().free_all_blocks()
        chunked.MAX_CHUNK_NNZ = base_cap
        row = {"S": S, "subset": k, **{kk: v for kk, v in res.items()}}
        row["same_bits"] = len({v[1] for v in res.values()}) == 1
        rows_out.append(row); print(json.dumps(row), flush=True)
json.dump(rows_out, open(os.path.join(out, "cluster_probe.json"), "w"), indent=1)
s16 = [r for r in rows_out if r["S"] == 16]
for key in ("product", "cl1", "cl2", "cl4"):
    print(key, "S=16 summed %.1f us" % sum(r[key][0] for r in s16), "S=1 %.1f us" % [r for r in rows_out if r["S"] == 1][0][key][0])
