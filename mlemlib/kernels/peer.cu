// The peer exchange of the one-process multi-GPU backend (compiled at run time by cupy.RawModule; launched by
// mlemlib/backends/_peer.py): an in-place sum all-reduce of P GPUs' 64-bit fixed-point vectors over NVLink peer
// access, in place of NCCL's.
//
// GPU k of P, on its own stream: peer_barrier (every GPU has finished what came before on its stream), then
// peer_sum_u64 over its slice [v0, v1) of the vector: the P GPUs' values read from their memory (peer reads),
// summed, and the sum written into every GPU's vector (peer writes), then peer_barrier again (every GPU has
// every slice, and no GPU reads a vector that the next step overwrites). The slices are disjoint, so the sum can
// be written in place. Integer sums are exact in any order: the result is NCCL's to the bit.
//
// peer_barrier: one thread counts the barriers it has passed (epoch, on its GPU: every GPU launches the same
// sequence of barriers, so the counts agree), writes the new count into slot `me` of every other GPU's flags and
// waits until every other GPU has written at least that count into its own. A GPU that waits more than
// timeout_ns (the global timer) stops waiting and records the peer it waited for (err = peer + 1); the launcher
// reads err when the backend synchronises and raises instead of returning a wrong image.

extern "C" {
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void peer_barrier(unsigned int* __restrict__ epoch, const unsigned long long* __restrict__ flag_ptrs,
                             int P, int me, unsigned int* flags, int* __restrict__ err,
                             unsigned long long timeout_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const unsigned int e = epoch[0] + 1;
    epoch[0] = e;
    __threadfence_system();  // what this GPU wrote before (its vector, its slices in the peers') is seen first
    for (int p = 0; p < P; ++p)
        if (p != me) atomicExch_system(reinterpret_cast<unsigned int*>(flag_ptrs[p]) + me, e);
    const unsigned long long t0 = global_ns();
    for (int p = 0; p < P; ++p) {
        if (p == me) continue;
        // counts wrap at 2^32 barriers: compared as a signed difference
        while ((int)(*reinterpret_cast<volatile unsigned int*>(flags + p) - e) < 0) {
            if (global_ns() - t0 > timeout_ns) {
                atomicExch(err, p + 1);
                break;
            }
        }
    }
    __threadfence_system();
}

__global__ void peer_sum_u64(const unsigned long long* __restrict__ ptrs, int P, long long v0, long long v1) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long j = v0 + (long long)blockIdx.x * blockDim.x + threadIdx.x; j < v1; j += stride) {
        unsigned long long s = 0;
        for (int p = 0; p < P; ++p) s += reinterpret_cast<const unsigned long long*>(ptrs[p])[j];
        for (int p = 0; p < P; ++p) reinterpret_cast<unsigned long long*>(ptrs[p])[j] = s;
    }
}

// The same exchange with EM's update fused (a CUDA graph's OSEM sub-iteration or MLEM iteration): GPU k sums its
// slice, rounds bp = sum / scale to float as fixed_to_float does, updates its slice of the image as
// _cuda_kernels.update_fixed does (the same expression, so the same bits) and writes the slice into every GPU's
// image; the fixed-point vectors keep each GPU's own terms.
__global__ void peer_sum_update_f32(const unsigned long long* __restrict__ accs,
                                    const unsigned long long* __restrict__ images, int P, int me, long long v0,
                                    long long v1, double inv_scale, const float* __restrict__ norm) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const float* f = reinterpret_cast<const float*>(images[me]);
    for (long long j = v0 + (long long)blockIdx.x * blockDim.x + threadIdx.x; j < v1; j += stride) {
        unsigned long long s = 0;
        for (int p = 0; p < P; ++p) s += reinterpret_cast<const unsigned long long*>(accs[p])[j];
        const float bp = (float)((double)s * inv_scale);
        const float nm = norm[j], fv = f[j];
        const float out = (nm != 0.0f) ? (nm == nm ? fv * bp / nm : fv) : fv * bp;
        for (int p = 0; p < P; ++p) reinterpret_cast<float*>(images[p])[j] = out;
    }
}
}
