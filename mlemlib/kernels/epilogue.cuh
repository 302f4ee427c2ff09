// The row epilogue shared by spmv.cu and compressed.cu (each has `#include "epilogue.cuh"`,
// which the library's loader, mlemlib.backends._cuda_kernels.kernel_source, replaces with
// this text). A row's sum `sum` of A x becomes y[r]:
//   MODE_PLAIN   y[r] = sum
//   MODE_CORR    y[r] = sum != 0 ? aux0[r] / sum : 0               (correlation, aux0 = g)
//   MODE_UPDATE  y[r] = aux1[r] != 0 ? aux0[r] * sum / aux1[r]     (update, aux0 = f, aux1 = norm)
//                       : aux0[r] * sum
//                (aux1[r] NaN: y[r] = aux0[r], an OSEM subset that does not see voxel r keeps it)
//   MODE_CORR_BG y[r] = d != 0 ? aux0[r] / d : 0, d = sum + aux1[r]  (correlation with the
//                expected background per unit of sensitivity, aux1 = b / m; +inf at a gap: 0)
// The operands are loaded before the row's dot product (load_aux) so that their latency
// overlaps it. y and aux0 may alias (in-place update): row r reads aux0[r] and writes
// y[r], and no other row touches r.
#pragma once

typedef long long i64;

#define MODE_PLAIN 0
#define MODE_CORR 1
#define MODE_UPDATE 2
#define MODE_CORR_BG 3

struct RowAux {
    float a0, a1;
};

__device__ __forceinline__ RowAux load_aux(int mode, i64 r, const float* aux0, const float* aux1) {
    RowAux p{0.0f, 0.0f};
    if (mode != MODE_PLAIN) p.a0 = aux0[r];
    if (mode == MODE_UPDATE || mode == MODE_CORR_BG) p.a1 = aux1[r];
    return p;
}

__device__ __forceinline__ void write_row(int mode, i64 r, float sum, float* y, RowAux p) {
    float out;
    if (mode == MODE_CORR) {
        out = (sum != 0.0f) ? p.a0 / sum : 0.0f;
    } else if (mode == MODE_UPDATE) {
        out = (p.a1 != 0.0f) ? (p.a1 == p.a1 ? p.a0 * sum / p.a1 : p.a0) : p.a0 * sum;
    } else if (mode == MODE_CORR_BG) {
        const float d = sum + p.a1;
        out = (d != 0.0f) ? p.a0 / d : 0.0f;
    } else {
        out = sum;
    }
    y[r] = out;
}

// The one passes' ratio of row r: c_r = g_r / (fp_r + bg_r), 0 where that is 0; bg null: no
// background (g_r / fp_r, the same bits as before backgrounds existed).
__device__ __forceinline__ float row_ratio(float sum, const float* __restrict__ g, const float* __restrict__ bg, i64 r) {
    const float d = bg != nullptr ? sum + __ldg(bg + r) : sum;
    return d != 0.0f ? __ldg(g + r) / d : 0.0f;
}

// The launch order of the atomic kernels (scatter_L, cscatter, the one passes): lane group w takes
// the rows of unit (w / U) * P mod nunits, U consecutive rows per unit, nunits = ceil(m / U)
// (P coprime with nunits: every unit once; P = 1: rows in order). The host's P
// (_cuda_plan.spread_stride, near nunits over the golden ratio) spreads the rows in flight
// together over the whole matrix: in a scanner's LOR order neighbouring rows are neighbouring
// LORs whose atomics meet on the same voxels. A row index >= m
// (the last unit's tail) is no row. w * P must fit 64 bits: the host gives P = 1 from 2^32 units.
__device__ __forceinline__ i64 spread_rows(i64 w, i64 P, i64 U, i64 m) {
    if (P == 1) return w;
    const i64 u = w / U;
    const i64 nunits = (m + U - 1) / U;
    return (i64)(((unsigned long long)u * (unsigned long long)P) % (unsigned long long)nunits) * U + (w - u * U);
}

// Lane groups a spread launch needs: every unit whole (P = 1: m).
__device__ __forceinline__ i64 spread_groups(i64 P, i64 U, i64 m) {
    return P == 1 ? m : (m + U - 1) / U * U;
}
