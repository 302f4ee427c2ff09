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
// (The MAP step of the GPU backends, which forms the gradient in float, is map_step.cu.)

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
