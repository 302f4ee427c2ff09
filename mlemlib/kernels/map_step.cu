// The MAP step of the GPU backends (compiled at run time by cupy.RawModule; launched by mlemlib/_map_cuda.py).
//
// Compiled with NVRTC's defaults (multiply-adds contracted): the step forms the prior's terms in float and
// matches no CPU computation bit for bit (prior.cu's stencils, which serve the objective and the tests, are
// compiled with --fmad=false instead). The same inputs give the same bits on every GPU and rerun.
//
// The step replaces EM's update of one sub-iteration: map_to_grid copies the image f (the caller's order) to fu on the user's grid,
// fu[pos[j']] = f[j']; map_update runs one thread per user voxel u, reads its neighbours from fu (coalesced: the
// permutation is applied once per voxel, not once per neighbour), forms the prior's gradient as prior_stencil
// does (the same terms, in float) and writes the updated f[j'] at j' = inv[u], and where fu_next is given the
// same value at u there (the next sub-iteration's fu, so that it needs no map_to_grid). The norm of the subset
// and 1 / s are read on the user's grid as well (norm_u, inv_s_u); only bp (or acc) and f go through j':
//   BSREM (algorithm 0): f <- max(nu, f + lambda (f / s) (S G - beta grad)), 0 where 1 / s is 0, G = bp - sk
//   OSL   (algorithm 1): f <- f bp / (sk + beta grad / S) where sk > 0 and that is > 0, else EM's update
//   (hessian != 0: BSREM's step divided by 1 + beta f H / s, H = the prior's curvature at f: the preconditioner
//    f / (s + beta f H) instead of f / s)
//   (offset: f + offset in place of f in the preconditioner, f / s or f / (s + beta f H); 0: none)
//   (average: mean, in f's order, sums the pass's sub-iterates, from first's on, and holds their mean, the sum
//    divided by S, once the last one (write_next 0) is added)
//   (summed: bp is bpsum + bp, the back projections of the subsets a sub-iteration covers, sk their summed norm
//    and S the pass's sub-iterations: nsub is S over the subsets per sub-iteration)
// lambda is read from the device (set before each pass). kappa_u is kappa on the user's grid. The 26 neighbours
// are loops over (dz, dy, dx) unrolled, with 32-bit indices (the launcher checks n < 2^31), and the pair terms
// are formed in float with a fast reciprocal (prior.cu's stencils use double: they serve the objective and the
// tests): the step is as accurate as the float image it updates, and costs little beside the projections.

extern "C" {
// A sub-iteration that covers several subsets (BSREM's subset halving) adds each subset's all-reduced back
// projection but the last into bpsum (in f's order, the first one written, not added), and the last one's
// map_update reads bp + bpsum with the merged subsets' summed norm.
__global__ void map_accumulate_f32(float* __restrict__ bpsum, const float* __restrict__ bpf,
                                   const unsigned long long* __restrict__ acc, double inv_scale, int fixed,
                                   int first, long long n) {
    for (long long jp = blockIdx.x * (long long)blockDim.x + threadIdx.x; jp < n; jp += (long long)gridDim.x * blockDim.x) {
        float bp = fixed ? (float)((double)acc[jp] * inv_scale) : bpf[jp];
        bpsum[jp] = first ? bp : bpsum[jp] + bp;
    }
}
__global__ void map_to_grid_f32(const float* __restrict__ f, const long long* __restrict__ pos, long long n,
                                float* __restrict__ fu) {
    for (long long jp = blockIdx.x * (long long)blockDim.x + threadIdx.x; jp < n; jp += (long long)gridDim.x * blockDim.x)
        fu[pos[jp]] = f[jp];
}

__global__ void map_update_f32(const float* __restrict__ fu, const float* __restrict__ kappa_u,
                               const long long* __restrict__ inv, int has_kappa, int perm, int n, int nx, int ny,
                               int nz, int kind, float gamma, float eps, int algorithm, float* __restrict__ f,
                               const float* __restrict__ bpf, const unsigned long long* __restrict__ acc,
                               double inv_scale, int fixed, const float* __restrict__ norm_u,
                               const float* __restrict__ inv_s_u, const float* __restrict__ lam, float beta, float nsub,
                               float floor_, int hessian, float offset, float* __restrict__ fu_next, int write_next,
                               float* __restrict__ mean, int average, int first,
                               const float* __restrict__ bpsum, int summed) {
    for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < n; u += gridDim.x * blockDim.x) {
        long long jp = perm ? inv[u] : u;
        float a = fu[u];
        float is = inv_s_u[u];
        float grad = 0.0f, curv = 0.0f;
        if (beta != 0.0f && is != 0.0f) {  // where s = 0 no update reads the gradient
            int x = u % nx, t = u / nx, y = t % ny, z = t / ny;
            float gsum = 0.0f, hsum = 0.0f;
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
                        int k = row + x + dx;
                        float kk = has_kappa ? wk * kappa_u[k] : wk;
                        float b = fu[k];
                        float d = a - b;
                        if (kind == 1) {  // quadratic: phi = d^2 / 2
                            gsum += kk * d;
                            hsum += kk;
                        } else {  // rdp: phi = d^2 / (a + b + gamma |d| + eps)
                            float ad = fabsf(d);
                            float r = __fdividef(1.0f, a + b + gamma * ad + eps);
                            float num = a + 3.0f * b + gamma * ad + 2.0f * eps;
                            gsum += kk * (d * num * r * r);
                            if (hessian) {
                                float sgn = d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : 0.0f);
                                hsum += kk * (2.0f * r - 2.0f * d * num * (1.0f + gamma * sgn) * r * r * r);
                            }
                        }
                    }
                }
            }
            float kj = has_kappa ? kappa_u[u] : 1.0f;
            grad = kj * gsum;
            curv = kj * hsum;
        }
        float bp = fixed ? (float)((double)acc[jp] * inv_scale) : bpf[jp];
        if (summed) bp = bpsum[jp] + bp;  // a sub-iteration over several subsets: theirs summed before
        float nk = norm_u[u];
        float out;
        if (algorithm == 0) {
            float sk = (nk == nk) ? nk : 0.0f;
            if (is == 0.0f) {
                out = 0.0f;
            } else {
                float pa = a + offset;  // f, or f + delta, in the preconditioner
                float step = (pa * is) * (nsub * (bp - sk) - beta * grad);
                if (hessian) step /= 1.0f + beta * pa * curv * is;
                float v = a + lam[0] * step;
                out = v > floor_ ? v : floor_;
            }
        } else {
            float den = nk + (beta / nsub) * grad;
            out = (nk > 0.0f && den > 0.0f) ? a * bp / den : ((nk != 0.0f) ? (nk == nk ? a * bp / nk : a) : a * bp);
        }
        f[jp] = out;
        if (write_next) fu_next[u] = out;
        if (average) {  // the pass's mean image: the sub-iterates summed in order, divided by S after the last
            float m = first ? out : mean[jp] + out;
            mean[jp] = write_next ? m : m / nsub;
        }
    }
}
}
