// Synthetic tube-of-response (TOR) system matrix, generated on the GPU.
//
// The same geometry as mlemlib.bench.tor_matrix (CPU, Numba), formula for
// formula; compile with --fmad=false so the float64 arithmetic rounds as on
// the host and both give identical arrays.
//
// Rows are in sinogram order: row = (plane * n_angles + angle) * n_offsets + offset.
// A row is the strip |(x - cx) cos(theta) + (y - cy) sin(theta) - s| < w through
// the slices z = plane and plane + 1 (one slice when nz == 1); voxel (x, y, z)
// is column z * nx * ny + y * nx + x, so each row's columns are sorted; the
// value is 1 - d / w with d the distance of the voxel centre from the line.
//
// tor_count writes each row's length, tor_fill the columns and values at the
// row pointer computed from those lengths. One thread per row.

typedef long long i64;

struct Geometry {
    int nx, ny, nz, n_angles, n_offsets;
    double w, ds, cx, cy;
};

template <bool FILL>
__device__ int tor_row(i64 r, const Geometry g, const double* __restrict__ cs_tab,
                       const double* __restrict__ sn_tab, int* __restrict__ col,
                       float* __restrict__ val) {
    const i64 per_plane = (i64)g.n_angles * g.n_offsets;
    const int plane = (int)(r / per_plane);
    const int angle = (int)((r % per_plane) / g.n_offsets);
    const int offset = (int)(r % g.n_offsets);
    const double cs = cs_tab[angle], sn = sn_tab[angle];
    const double s = ((double)offset - (double)(g.n_offsets - 1) * 0.5) * g.ds;
    const int nslices = g.nz > 1 ? 2 : 1;
    int count = 0;
    for (int dz = 0; dz < nslices; ++dz) {
        const int z = plane + dz;
        for (int y = 0; y < g.ny; ++y) {
            const double u = ((double)y - g.cy) * sn - s;
            int xlo, xhi;
            if (cs == 0.0) {
                xlo = 0;
                xhi = g.nx - 1;
            } else {
                double xa = g.cx + (-u - g.w) / cs, xb = g.cx + (-u + g.w) / cs;
                if (xa > xb) {
                    const double t = xa;
                    xa = xb;
                    xb = t;
                }
                xa = fmax(xa, -1.0);
                xb = fmin(xb, (double)g.nx);
                xlo = (int)floor(xa);
                xhi = (int)ceil(xb);
                if (xlo < 0) xlo = 0;
                if (xhi > g.nx - 1) xhi = g.nx - 1;
            }
            for (int x = xlo; x <= xhi; ++x) {
                const double d = fabs(((double)x - g.cx) * cs + u);
                if (d < g.w) {
                    if (FILL) {
                        col[count] = (z * g.ny + y) * g.nx + x;
                        val[count] = (float)(1.0 - d / g.w);
                    }
                    ++count;
                }
            }
        }
    }
    return count;
}

#define GEOMETRY_ARGS int nx, int ny, int nz, int n_angles, int n_offsets, double w, double ds, double cx, double cy
#define MAKE_GEOMETRY const Geometry g = {nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy}

extern "C" __global__ void tor_count(GEOMETRY_ARGS, i64 m, const double* cs_tab, const double* sn_tab,
                                     int* counts) {
    MAKE_GEOMETRY;
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < m; r += (i64)gridDim.x * blockDim.x)
        counts[r] = tor_row<false>(r, g, cs_tab, sn_tab, nullptr, nullptr);
}

extern "C" __global__ void tor_fill(GEOMETRY_ARGS, i64 m, const double* cs_tab, const double* sn_tab,
                                    const i64* rowptr, int* col, float* val) {
    MAKE_GEOMETRY;
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < m; r += (i64)gridDim.x * blockDim.x)
        tor_row<true>(r, g, cs_tab, sn_tab, col + rowptr[r], val + rowptr[r]);
}
