// reduce_sum.cu -- the sum of a float32 vector, in three stages.
//
// A reduction reads every element once and does one add per element, so it is
// memory-bound: the floor is n * 4 bytes / memory bandwidth (1 GiB of floats on an
// H100 at ~3 TB/s: ~0.36 ms). The kernel's job is to keep enough loads in flight to
// reach that bandwidth and to combine the partial sums cheaply. It does so in stages,
// from the cheapest (registers) to the dearest (a second launch):
//
//   1. Grid-stride loop: a fixed grid of a few blocks per multiprocessor walks the
//      whole vector; each thread adds its elements into a register. 16-byte float4
//      loads (when the pointer allows) move four floats per instruction, and each
//      thread issues four of them before it adds, to keep many bytes in flight.
//   2. Warp shuffle: the 32 threads of a warp add their registers together with
//      __shfl_down_sync, register to register, with no shared memory and no barrier.
//   3. Shared memory: lane 0 of each warp writes its warp's sum to shared memory; after
//      one __syncthreads the first warp adds those (at most 32) partials the same way.
//
// Each block writes one partial sum to out[blockIdx.x]. The host then launches this
// same kernel once more, with one block, over the partials: a second pass instead of
// atomicAdd, so the result does not depend on the order in which blocks finish
// (deterministic, bit for bit, run to run).
//
// Launch: any grid, blockDim.x a multiple of 32 and at most 1024; out has gridDim.x floats.
// FLOPs: n adds. Bytes: 4 n read (+ 4 per block written, negligible).

__device__ __forceinline__ float warp_sum(float v)
{
    // Each step halves the number of live values: lane i adds lane i + offset.
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, offset);
    return v;  // lane 0 holds the warp's total
}

extern "C" __global__ void reduce_sum_f32(const float* __restrict__ x, long long n,
                                          float* __restrict__ out)
{
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;

    // Stage 1: grid-stride accumulation in a register.
    float acc = 0.0f;
    if ((reinterpret_cast<unsigned long long>(x) & 15ull) == 0ull) {
        // Aligned: four floats per load. Neighbouring threads read neighbouring 16-byte
        // chunks, so a warp reads 512 contiguous bytes per instruction (coalesced).
        const float4* x4 = reinterpret_cast<const float4*>(x);
        const long long n4 = n >> 2;
        long long i = tid;
        // Four independent loads issued before any add: 64 bytes in flight per thread,
        // so fewer threads suffice to cover the memory latency.
        for (; i + 3 * stride < n4; i += 4 * stride) {
            const float4 v0 = x4[i], v1 = x4[i + stride];
            const float4 v2 = x4[i + 2 * stride], v3 = x4[i + 3 * stride];
            acc += ((v0.x + v0.y) + (v0.z + v0.w)) + ((v1.x + v1.y) + (v1.z + v1.w))
                 + ((v2.x + v2.y) + (v2.z + v2.w)) + ((v3.x + v3.y) + (v3.z + v3.w));
        }
        for (; i < n4; i += stride) {
            const float4 v = x4[i];
            acc += (v.x + v.y) + (v.z + v.w);
        }
        // The last n % 4 elements, one per thread.
        for (long long i = (n4 << 2) + tid; i < n; i += stride)
            acc += x[i];
    } else {
        // A view starting at an odd offset: plain 4-byte loads, still coalesced.
#pragma unroll 4
        for (long long i = tid; i < n; i += stride)
            acc += x[i];
    }

    // Stage 2: reduce within each warp.
    acc = warp_sum(acc);

    // Stage 3: one partial per warp in shared memory, then the first warp adds them.
    __shared__ float warp_partials[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0)
        warp_partials[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x >> 5;
        acc = lane < n_warps ? warp_partials[lane] : 0.0f;
        acc = warp_sum(acc);
        if (lane == 0)
            out[blockIdx.x] = acc;
    }
}
