// The MAP step of the GPU backends (compiled at run time by cupy.RawModule; launched by mlemlib/_map_cuda.py).
//
// Compiled with NVRTC's defaults (multiply-adds contracted): the step forms the prior's terms in float and
// matches no CPU computation bit for bit (prior.cu's stencils, which serve the objective and the tests, are
// compiled with --fmad=false instead). The same inputs give the same bits on every GPU and rerun.
//
// One build per run's prior: MAP_KIND (0 the RDP, 1 the quadratic prior), MAP_HESSIAN (BSREM's preconditioner
// holds the prior's curvature) and MAP_KAPPA (per-voxel weights) are compile-time constants, so that the
// neighbour loop holds only the arithmetic of the run's prior. The back projection comes as float32 (bpf) or as
// the deterministic kernels' 64-bit fixed point (acc and its inv_scale, fixed = 1).
//
// The step replaces EM's update of one subset's launch k of the pass (k = 0, ..., S - 1). map_to_grid copies the
// image f (the caller's order) to fu on the user's grid, fu[pos[j']] = f[j'], before launch 0; map_update runs
// one thread per user voxel u, reads its neighbours from fu (coalesced: the permutation is applied once per
// voxel, not once per neighbour), forms the prior's gradient and writes the updated f[j'] at j' = inv[u], and the
// same value at u in the other fu buffer (the next sub-iteration's, so that it needs no map_to_grid). The subset's
// norm and 1 / s are read on the user's grid as well; only bp (or acc) and f go through j':
//   BSREM (algorithm 0): f <- max(nu, f + lambda (f / s) (S G - beta grad)), 0 where 1 / s is 0, G = bp - sk
//   OSL   (algorithm 1): f <- f bp / (sk + beta grad / S) where sk > 0 and that is > 0, else EM's update
//   (MAP_HESSIAN: BSREM's step divided by 1 + beta f H / s, H = the prior's curvature at f: the preconditioner
//    f / (s + beta f H) instead of f / s)
//   (offset: f + offset in place of f in the preconditioner, f / s or f / (s + beta f H); 0: none)
//   (average: mean, in f's order, sums the pass's sub-iterates and holds their mean, the sum divided by the
//    pass's sub-iteration count, once the last one is added)
// What launch k does for the subsets per sub-iteration g (BSREM's subset halving) and lambda are read from the
// device (steps[k], lam[0]; set between passes), so that one captured pass serves every g: launch k is the last of
// its sub-iteration q = k / g when k % g = g - 1, and updates with bp summed over the sub-iteration's subsets
// (bpsum + bp), their summed norm and S / g sub-iterations per pass; the launches before it only add their bp into
// bpsum (in f's order) and leave f as it is.
//
// The RDP's pair term, with den = a + b + gamma |d| + eps and d = a - b, is d (den + 2 b + eps) / den^2 =
// (d / den) (1 + (2 b + eps) / den) (one reciprocal), its curvature 2 / den (1 - term (1 + gamma sgn d)) =
// 2 / den (1 - term - gamma |term|) (term has the sign of d). The 26
// neighbours are loops over (dz, dy, dx) unrolled, with 32-bit indices (the launcher checks n < 2^31), the terms
// formed in float with a fast reciprocal (prior.cu's stencils use double: they serve the objective and the
// tests): the step is as accurate as the float image it updates.

#ifndef MAP_KIND
#define MAP_KIND 0
#endif
#ifndef MAP_HESSIAN
#define MAP_HESSIAN 0
#endif
#ifndef MAP_KAPPA
#define MAP_KAPPA 0
#endif

extern "C" {
__global__ void map_to_grid_f32(const float* __restrict__ f, const int* __restrict__ pos, int n,
                                float* __restrict__ fu) {
    for (int jp = blockIdx.x * blockDim.x + threadIdx.x; jp < n; jp += gridDim.x * blockDim.x) fu[pos[jp]] = f[jp];
}

// q = a / b and r = a % b for 0 <= a < 2^31, 0 < b (a runtime divisor, where the integer division is a software
// routine): the quotient from a float reciprocal, then corrected to the exact one by integer steps, each a compare
// and an add (at most one for a < 2^24, at most about a / (b 2^22) + 1 beyond).
__device__ __forceinline__ void divide(int a, int b, int& q, int& r) {
    q = __float2int_rz(__int2float_rz(a) * __frcp_rn(__int2float_rn(b)));
    r = a - q * b;
    while (r < 0) {
        --q;
        r += b;
    }
    while (r >= b) {
        ++q;
        r -= b;
    }
}

// The updated value of user voxel u (the image on the grid fu, its back projection bp).
__device__ __forceinline__ float step_voxel(int u, float bp, const float* __restrict__ fu,
                                            const float* __restrict__ kappa_u, int nx, int ny, int nz, float gamma,
                                            float eps, int algorithm, const float* __restrict__ norm_u,
                                            const float* __restrict__ inv_s_u, float lam0, float beta, float nsub,
                                            float floor_, float offset) {
    float a = fu[u];
    float is = inv_s_u[u];
    float grad = 0.0f, curv = 0.0f;
    if (beta != 0.0f && is != 0.0f) {  // where s = 0 no update reads the gradient
        int t, x, y, z;
        divide(u, nx, t, x);
        divide(t, ny, z, y);
        float gsum = 0.0f, hsum = 0.0f;
        const float ae = a + eps;
#pragma unroll
        for (int dz = -1; dz <= 1; ++dz) {
            if ((unsigned)(z + dz) >= (unsigned)nz) continue;
#pragma unroll
            for (int dy = -1; dy <= 1; ++dy) {
                if ((unsigned)(y + dy) >= (unsigned)ny) continue;
                int row = ((z + dz) * ny + (y + dy)) * nx;
#pragma unroll
                for (int dx = -1; dx <= 1; ++dx) {
                    if (dx == 0 && dy == 0 && dz == 0) continue;
                    if ((unsigned)(x + dx) >= (unsigned)nx) continue;
                    // the weight 1 / distance: 1, 1 / sqrt(2), 1 / sqrt(3) (a constant once unrolled)
                    int c = (dx != 0) + (dy != 0) + (dz != 0);
                    float wk = c == 1 ? 1.0f : (c == 2 ? 0.70710678118654752f : 0.57735026918962576f);
                    int kn = row + x + dx;
                    float kk = MAP_KAPPA ? wk * kappa_u[kn] : wk;
                    float b = fu[kn];
                    float d = a - b;
                    if (MAP_KIND == 1) {  // quadratic: phi = d^2 / 2
                        gsum = fmaf(kk, d, gsum);
                        if (MAP_HESSIAN) hsum += kk;
                    } else {  // rdp: phi = d^2 / (a + b + gamma |d| + eps)
                        float r = __fdividef(1.0f, fmaf(gamma, fabsf(d), ae + b));
                        float term = (d * r) * fmaf(fmaf(2.0f, b, eps), r, 1.0f);
                        gsum = fmaf(kk, term, gsum);
                        if (MAP_HESSIAN) hsum = fmaf(2.0f * kk, r * fmaf(-gamma, fabsf(term), 1.0f - term), hsum);
                    }
                }
            }
        }
        float kj = MAP_KAPPA ? kappa_u[u] : 1.0f;
        grad = kj * gsum;
        curv = kj * hsum;
    }
    float nk = norm_u[u];
    float out;
    if (algorithm == 0) {
        float sk = (nk == nk) ? nk : 0.0f;
        if (is == 0.0f) {
            out = 0.0f;
        } else {
            float pa = a + offset;  // f, or f + delta, in the preconditioner
            float step = (pa * is) * (nsub * (bp - sk) - beta * grad);
            if (MAP_HESSIAN) step /= 1.0f + beta * pa * curv * is;
            float v = a + lam0 * step;
            out = v > floor_ ? v : floor_;
        }
    } else {
        float den = nk + (beta / nsub) * grad;
        out = (nk > 0.0f && den > 0.0f) ? a * bp / den : ((nk != 0.0f) ? (nk == nk ? a * bp / nk : a) : a * bp);
    }
    return out;
}

// One sub-iteration's update (the launch that is the last of its sub-iteration), reading the image on the grid
// from fu and writing the next copy into fu_next (two buffers in turn, fixed per instantiation, so that neither is
// a pointer chosen at run time).
__device__ __forceinline__ void update(const float* __restrict__ fu, float* __restrict__ fu_next,
                                       const float* __restrict__ kappa_u, const int* __restrict__ inv, int perm,
                                       int n, int nx, int ny, int nz, float gamma, float eps, int algorithm,
                                       float* __restrict__ f, const float* __restrict__ bpf,
                                       const unsigned long long* __restrict__ acc, double inv_scale, int fixed,
                                       const float* __restrict__ norm_u, const float* __restrict__ inv_s_u,
                                       float lam0, float beta, float nsub, int write_next, int first, int summed,
                                       float floor_, float offset, float* __restrict__ mean, int average,
                                       const float* __restrict__ bpsum) {
    const int stride = gridDim.x * blockDim.x;
    for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < n; u += stride) {
        int jp = perm ? inv[u] : u;
        float bp = fixed ? (float)((double)acc[jp] * inv_scale) : bpf[jp];
        if (summed) bp = bpsum[jp] + bp;  // a sub-iteration over several subsets: theirs summed before
        float out = step_voxel(u, bp, fu, kappa_u, nx, ny, nz, gamma, eps, algorithm, norm_u, inv_s_u, lam0, beta,
                               nsub, floor_, offset);
        f[jp] = out;
        if (write_next) fu_next[u] = out;
        if (average) {  // the pass's mean image: the sub-iterates summed in order, divided by S / g after the last
            float m = first ? out : mean[jp] + out;
            mean[jp] = write_next ? m : m / nsub;
        }
    }
}

// Launch k of the pass: steps[k] = (what, q, row, nsub), written by the host for the current g (the subsets per
// sub-iteration) between passes: what 0 / 1 adds bp into bpsum (0: the first of its sub-iteration, written),
// 2 / 3 updates as sub-iteration q of nsub with the norm in row `row` of norms (3: bp + bpsum).
__global__ void map_update_f32(float* __restrict__ fu0, float* __restrict__ fu1, const float* __restrict__ kappa_u,
                               const int* __restrict__ inv, int perm, int n, int nx, int ny, int nz, float gamma,
                               float eps, int algorithm, float* __restrict__ f, const float* __restrict__ bpf,
                               const unsigned long long* __restrict__ acc, double inv_scale, int fixed,
                               const float* __restrict__ norms, const float* __restrict__ inv_s_u,
                               const float* __restrict__ lam, const int4* __restrict__ steps, int k,
                               float beta, float floor_, float offset, float* __restrict__ mean, int average,
                               float* __restrict__ bpsum) {
    const int4 st = steps[k];
    if (st.x < 2) {  // not the last subset of its sub-iteration: its bp added to the others', f unchanged
        for (int jp = blockIdx.x * blockDim.x + threadIdx.x; jp < n; jp += gridDim.x * blockDim.x) {
            float bp = fixed ? (float)((double)acc[jp] * inv_scale) : bpf[jp];
            bpsum[jp] = st.x == 0 ? bp : bpsum[jp] + bp;
        }
        return;
    }
    const int q = st.y;
    const float* __restrict__ norm_u = norms + (long long)st.z * n;
    const int write_next = q + 1 < st.w, first = q == 0, summed = st.x == 3;
    if (q & 1)
        update(fu1, fu0, kappa_u, inv, perm, n, nx, ny, nz, gamma, eps, algorithm, f, bpf, acc, inv_scale, fixed,
               norm_u, inv_s_u, lam[0], beta, (float)st.w, write_next, first, summed, floor_, offset, mean, average,
               bpsum);
    else
        update(fu0, fu1, kappa_u, inv, perm, n, nx, ny, nz, gamma, eps, algorithm, f, bpf, acc, inv_scale, fixed,
               norm_u, inv_s_u, lam[0], beta, (float)st.w, write_next, first, summed, floor_, offset, mean, average,
               bpsum);
}

// Launch k of the pass on GPU `me` of P with the peer exchange (mlemlib/backends/_peer.py; between its two
// barriers, in a captured pass): GPU me takes the voxels j' in [v0, v1) of f's order, sums their fixed-point back
// projection over every GPU's acc, and writes what map_update_f32 writes at them (f, the next grid copy at
// u = pos[j'], the pass mean) into every GPU's arrays (the tables hold each GPU's address of an array, in GPU order);
// bpsum holds the slice's sums on its own GPU only. The same bits as the all-reduce then map_update_f32.
__global__ void map_update_peer_f32(const unsigned long long* __restrict__ fu0s,
                                    const unsigned long long* __restrict__ fu1s, const float* __restrict__ kappa_u,
                                    const int* __restrict__ pos, int perm, int nx, int ny, int nz, float gamma,
                                    float eps, int algorithm, const unsigned long long* __restrict__ fs,
                                    const unsigned long long* __restrict__ accs, int P, int me, int v0, int v1,
                                    double inv_scale, const float* __restrict__ norms,
                                    const float* __restrict__ inv_s_u, const float* __restrict__ lam,
                                    const int4* __restrict__ steps, int k, int n, float beta, float floor_,
                                    float offset, const unsigned long long* __restrict__ means, int average,
                                    float* __restrict__ bpsum) {
    const int4 st = steps[k];
    const int stride = gridDim.x * blockDim.x;
    const int start = v0 + blockIdx.x * blockDim.x + threadIdx.x;
    if (st.x < 2) {  // not the last subset of its sub-iteration: its summed bp added to the others'
        for (int jp = start; jp < v1; jp += stride) {
            unsigned long long a = 0;
            for (int p = 0; p < P; ++p) a += reinterpret_cast<const unsigned long long*>(accs[p])[jp];
            float bp = (float)((double)a * inv_scale);
            bpsum[jp] = st.x == 0 ? bp : bpsum[jp] + bp;
        }
        return;
    }
    const int q = st.y;
    const float nsub = (float)st.w, lam0 = lam[0];
    const float* __restrict__ norm_u = norms + (long long)st.z * n;
    const int write_next = q + 1 < st.w, first = q == 0, summed = st.x == 3;
    const float* __restrict__ fu = reinterpret_cast<const float*>((q & 1) ? fu1s[me] : fu0s[me]);
    const unsigned long long* __restrict__ next = (q & 1) ? fu0s : fu1s;
    const float* __restrict__ mean_me = reinterpret_cast<const float*>(means[me]);
    for (int jp = start; jp < v1; jp += stride) {
        const int u = perm ? pos[jp] : jp;
        unsigned long long a = 0;
        for (int p = 0; p < P; ++p) a += reinterpret_cast<const unsigned long long*>(accs[p])[jp];
        float bp = (float)((double)a * inv_scale);
        if (summed) bp = bpsum[jp] + bp;
        const float out = step_voxel(u, bp, fu, kappa_u, nx, ny, nz, gamma, eps, algorithm, norm_u, inv_s_u, lam0,
                                     beta, nsub, floor_, offset);
        for (int p = 0; p < P; ++p) reinterpret_cast<float*>(fs[p])[jp] = out;
        if (write_next)
            for (int p = 0; p < P; ++p) reinterpret_cast<float*>(next[p])[u] = out;
        if (average) {
            float m = first ? out : mean_me[jp] + out;
            m = write_next ? m : m / nsub;
            for (int p = 0; p < P; ++p) reinterpret_cast<float*>(means[p])[jp] = m;
        }
    }
}
}
