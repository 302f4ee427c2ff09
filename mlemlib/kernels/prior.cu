// Prior stencils of MAP reconstruction (compiled at run time by cupy.RawModule; launched by mlemlib/_prior_cuda.py).
//
// A direct transcription of the Numba kernels of mlemlib/prior.py: the same pair terms, computed in double,
// the same 26 offsets in the same order (passed in by the launcher), the same gather through the voxel
// permutation. One thread per image voxel j' (in the caller's order): u = pos[j'] is its voxel on the user's
// grid, each neighbour k = u + offset on that grid is read at inv[k]. No atomics: every voxel's sum runs over
// its own neighbours in a fixed order, and the value's partial sums are reduced in a fixed tree per block of
// PRIOR_VALUE_BLOCK voxels (the blocks then summed in order by the launcher), so results repeat bit for bit.
//
// Kernels (extern "C"; _f32 for float images, _f64 for double):
//   prior_stencil_*  out[j'] = kappa_j sum_k w_k kappa_k dphi(f_j, f_k)   (second != 0: d2phi, the curvature)
//   prior_value_*    partial[b] = sum over voxels j' of block b and the 13 forward offsets of
//                    w kappa_j kappa_k phi(f_j, f_k)
//   map_to_grid_f32, map_update_f32   the MAP step of a GPU backend (below)

#define PRIOR_THREADS 256
#define PRIOR_VALUE_BLOCK 4096

__device__ __forceinline__ double prior_phi(double a, double b, int kind, double gamma, double eps) {
    double d = a - b;
    if (kind == 1) return 0.5 * d * d;
    return d * d / (a + b + gamma * fabs(d) + eps);
}

__device__ __forceinline__ double prior_dphi(double a, double b, int kind, double gamma, double eps) {
    double d = a - b;
    if (kind == 1) return d;
    double den = a + b + gamma * fabs(d) + eps;
    return d * (a + 3.0 * b + gamma * fabs(d) + 2.0 * eps) / (den * den);
}

__device__ __forceinline__ double prior_d2phi(double a, double b, int kind, double gamma, double eps) {
    if (kind == 1) return 1.0;
    double d = a - b;
    double den = a + b + gamma * fabs(d) + eps;
    double num = a + 3.0 * b + gamma * fabs(d) + 2.0 * eps;
    double sgn = d > 0 ? 1.0 : (d < 0 ? -1.0 : 0.0);
    return 2.0 / den - 2.0 * d * num * (1.0 + gamma * sgn) / (den * den * den);
}

// User index of the neighbour along offset o of the user voxel at (x, y, z); -1 outside the grid. The caller
// splits its voxel's index into (x, y, z) once, not once per neighbour (three 64-bit divisions each).
__device__ __forceinline__ long long prior_neighbour(long long x, long long y, long long z, int o, long long nx, long long ny,
                                                     long long nz, const long long* ox, const long long* oy,
                                                     const long long* oz) {
    long long xx = x + ox[o], yy = y + oy[o], zz = z + oz[o];
    if (xx < 0 || xx >= nx || yy < 0 || yy >= ny || zz < 0 || zz >= nz) return -1;
    return xx + nx * (yy + ny * zz);
}

template <typename T>
__device__ void prior_stencil(const T* __restrict__ f, const float* __restrict__ kappa, const long long* __restrict__ pos,
                              const long long* __restrict__ inv, int has_kappa, int perm, long long n, long long nx,
                              long long ny, long long nz, int kind, double gamma, double eps, const long long* ox,
                              const long long* oy, const long long* oz, const double* w, int second, T* __restrict__ out) {
    for (long long jp = blockIdx.x * (long long)blockDim.x + threadIdx.x; jp < n; jp += (long long)gridDim.x * blockDim.x) {
        long long u = perm ? pos[jp] : jp;
        long long x = u % nx, y = (u / nx) % ny, z = u / (nx * ny);
        double a = (double)f[jp];
        double kj = has_kappa ? (double)kappa[jp] : 1.0;
        double acc = 0.0;
        for (int o = 0; o < 26; ++o) {
            long long k = prior_neighbour(x, y, z, o, nx, ny, nz, ox, oy, oz);
            if (k < 0) continue;
            long long kp = perm ? inv[k] : k;
            double kk = has_kappa ? (double)kappa[kp] : 1.0;
            double b = (double)f[kp];
            double t = second ? prior_d2phi(a, b, kind, gamma, eps) : prior_dphi(a, b, kind, gamma, eps);
            acc += w[o] * kk * t;
        }
        out[jp] = (T)(kj * acc);
    }
}

// One thread block per PRIOR_VALUE_BLOCK voxels (launched with PRIOR_THREADS threads and ceil(n / PRIOR_VALUE_BLOCK)
// blocks): thread t sums voxels t, t + PRIOR_THREADS, ... of the block, then a fixed tree sums the threads.
template <typename T>
__device__ void prior_value(const T* __restrict__ f, const float* __restrict__ kappa, const long long* __restrict__ pos,
                            const long long* __restrict__ inv, int has_kappa, int perm, long long n, long long nx,
                            long long ny, long long nz, int kind, double gamma, double eps, const long long* ox,
                            const long long* oy, const long long* oz, const double* w, double* __restrict__ partial) {
    __shared__ double sums[PRIOR_THREADS];
    long long first = (long long)blockIdx.x * PRIOR_VALUE_BLOCK;
    long long last = min(n, first + PRIOR_VALUE_BLOCK);
    double acc = 0.0;
    for (long long jp = first + threadIdx.x; jp < last; jp += PRIOR_THREADS) {
        long long u = perm ? pos[jp] : jp;
        long long x = u % nx, y = (u / nx) % ny, z = u / (nx * ny);
        double a = (double)f[jp];
        double kj = has_kappa ? (double)kappa[jp] : 1.0;
        for (int o = 0; o < 13; ++o) {
            long long k = prior_neighbour(x, y, z, o, nx, ny, nz, ox, oy, oz);
            if (k < 0) continue;
            long long kp = perm ? inv[k] : k;
            double kk = has_kappa ? (double)kappa[kp] : 1.0;
            acc += w[o] * kj * kk * prior_phi(a, (double)f[kp], kind, gamma, eps);
        }
    }
    sums[threadIdx.x] = acc;
    __syncthreads();
    for (int half = PRIOR_THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sums[0];
}

// The MAP step of a GPU backend (launched by mlemlib/_map_cuda.py), in place of EM's update of one
// sub-iteration: map_to_grid copies the image f (the caller's order) to fu on the user's grid,
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
// lambda is read from the device (set before each pass). kappa_u is kappa on the user's grid. The 26 neighbours
// are loops over (dz, dy, dx) unrolled, with 32-bit indices (the launcher checks n < 2^31), and the pair terms
// are formed in float with a fast reciprocal (the stencils above use double: they serve the objective and the
// tests): the step is as accurate as the float image it updates, and costs little beside the projections.

extern "C" {
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
                               float floor_, int hessian, float offset, float* __restrict__ fu_next, int write_next) {
    for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < n; u += gridDim.x * blockDim.x) {
        long long jp = perm ? inv[u] : u;
        float a = fu[u];
        float grad = 0.0f, curv = 0.0f;
        if (beta != 0.0f) {
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
        float nk = norm_u[u];
        float out;
        if (algorithm == 0) {
            float is = inv_s_u[u];
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
    }
}
}

#define PRIOR_ARGS(T)                                                                                              \
    const T *f, const float *kappa, const long long *pos, const long long *inv, int has_kappa, int perm, long long n, \
        long long nx, long long ny, long long nz, int kind, double gamma, double eps, const long long *ox,         \
        const long long *oy, const long long *oz, const double *w
#define PRIOR_PASS f, kappa, pos, inv, has_kappa, perm, n, nx, ny, nz, kind, gamma, eps, ox, oy, oz, w

extern "C" {
__global__ void prior_stencil_f32(PRIOR_ARGS(float), int second, float* out) { prior_stencil<float>(PRIOR_PASS, second, out); }
__global__ void prior_stencil_f64(PRIOR_ARGS(double), int second, double* out) { prior_stencil<double>(PRIOR_PASS, second, out); }
__global__ void prior_value_f32(PRIOR_ARGS(float), double* partial) { prior_value<float>(PRIOR_PASS, partial); }
__global__ void prior_value_f64(PRIOR_ARGS(double), double* partial) { prior_value<double>(PRIOR_PASS, partial); }
}
