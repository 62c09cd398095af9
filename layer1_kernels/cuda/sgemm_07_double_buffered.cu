// sgemm_07_double_buffered.cu -- overlap the next slice's loads with this slice's math.
//
// Row-major float32: A is M x K, B is K x N, C is M x N. REQUIRES K % 4 == 0,
// N % 4 == 0 and 16-byte aligned A, B, C, like 06 (the host pads other shapes). Any M.
// FLOPs: 2 M N K. Fewest bytes: 4 (M K + K N + M N).
//
// What changed from 06 (same 128 x 128 block tile, 256 threads, 8 x 8 outputs each):
//
// 1. Double buffering. In 06 every slice goes: load from global -> store to shared ->
//    barrier -> compute -> barrier, so while a block waits for global memory its FMA
//    units idle (other resident blocks hide some of it, not all). Here shared memory
//    holds TWO slices. While the block computes on one, each thread has already issued
//    the global loads of the next slice into registers; only after the math does it
//    write them into the other buffer. The load latency hides behind 8 x 8 x BK FMAs,
//    and one barrier per slice suffices (a buffer is only rewritten after the barrier
//    that ends the last reads of it).
// 2. Warp-shaped thread layout. A warp's 32 threads cover a 4 x 8 grid of threads (32
//    rows x 64 columns of C) instead of 06's 2 x 16 (16 x 128): per k, its reads of A are
//    4 distinct float4s (64 bytes) and of B 8 (128 bytes), each one shared-memory
//    wavefront; 06 needed two for B. Fewer shared-memory cycles per FMA.
//
// Registers are the budget: 64 accumulators + 16 operands + 8 prefetched floats. With
// __launch_bounds__(256, 2) the compiler caps them at 128 per thread so that two blocks
// (16 warps) share an SM, and one block's barrier wait is covered by the other's math.
// BK stays 8: a 16-deep slice needs 8 more prefetch registers and spills under that cap
// (on an H100: BK=16 ~3% slower; BK=16 with one block per SM ~20% slower).
// Shared memory: 2 x (8 x 132 + 8 x 128) floats = 16.6 KB per block.
// Launch: block 256 (1-D), grid (ceil(N / 128), ceil(M / 128)).

#define BM 128
#define BN 128
#ifndef BK
#define BK 8
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
#define PAD 4
#define THREADS 256
#define A_LOADS ((BM * BK) / (4 * THREADS))  // float4s of A per thread per slice
#define B_LOADS ((BK * BN) / (4 * THREADS))  // float4s of B per thread per slice

// Issue this thread's LOADS float4 loads of the COLS-wide slice at (row0, col0) of a
// row-major rows x cols matrix (cols % 4 == 0): a float4 past the edges reads as zeros.
template <int COLS, int LOADS>
__device__ __forceinline__ void load_float4s(float4 (&dst)[LOADS], const float* __restrict__ src,
                                             int rows, int cols, int row0, int col0, int tid)
{
#pragma unroll
    for (int r = 0; r < LOADS; ++r) {
        const int idx = tid + r * THREADS;
        const int row = row0 + idx / (COLS / 4), col = col0 + (idx % (COLS / 4)) * 4;
        dst[r] = (row < rows && col < cols)
            ? *reinterpret_cast<const float4*>(&src[(long long)row * cols + col])
            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
sgemm_double_buffered(int M, int N, int K, const float* __restrict__ A,
                      const float* __restrict__ B, float* __restrict__ C)
{
    __shared__ __align__(16) float As[2][BK][BM + PAD];  // transposed: As[buf][k][m]
    __shared__ __align__(16) float Bs[2][BK][BN];

    const int tid = threadIdx.x;
    const int block_row = blockIdx.y * BM, block_col = blockIdx.x * BN;
    // Warp w covers thread rows (w/2)*4 .. +3 and thread columns (w%2)*8 .. +7.
    const int warp = tid / 32, lane = tid % 32;
    const int ty = (warp / 2) * 4 + lane / 8;  // 0..15
    const int tx = (warp % 2) * 8 + lane % 8;  // 0..15

    float4 a_next[A_LOADS], b_next[B_LOADS];  // the next slice, in flight in registers

    // Issue this thread's global loads of the slice starting at k0 (zeros out of range).
    auto load_slice = [&](int k0) {
        load_float4s<BK>(a_next, A, M, K, block_row, k0, tid);  // A's BM x BK slice
        load_float4s<BN>(b_next, B, K, N, k0, block_col, tid);  // B's BK x BN slice
    };
    // Write the registers into shared buffer `buf` (A transposed on the way).
    auto store_slice = [&](int buf) {
#pragma unroll
        for (int r = 0; r < A_LOADS; ++r) {
            const int idx = tid + r * THREADS;
            const int m = idx / (BK / 4), k = (idx % (BK / 4)) * 4;
            As[buf][k + 0][m] = a_next[r].x;
            As[buf][k + 1][m] = a_next[r].y;
            As[buf][k + 2][m] = a_next[r].z;
            As[buf][k + 3][m] = a_next[r].w;
        }
#pragma unroll
        for (int r = 0; r < B_LOADS; ++r) {
            const int idx = tid + r * THREADS;
            const int k = idx / (BN / 4), n = (idx % (BN / 4)) * 4;
            *reinterpret_cast<float4*>(&Bs[buf][k][n]) = b_next[r];
        }
    };

    float acc[8][8] = {{0.0f}};

    load_slice(0);
    store_slice(0);
    __syncthreads();

    int buf = 0;
    for (int k0 = 0; k0 < K; k0 += BK) {
        const bool has_next = k0 + BK < K;
        if (has_next)
            load_slice(k0 + BK);  // in flight while we compute below

#pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 a_lo = *reinterpret_cast<const float4*>(&As[buf][k][ty * 4]);
            const float4 a_hi = *reinterpret_cast<const float4*>(&As[buf][k][64 + ty * 4]);
            const float4 b_lo = *reinterpret_cast<const float4*>(&Bs[buf][k][tx * 4]);
            const float4 b_hi = *reinterpret_cast<const float4*>(&Bs[buf][k][64 + tx * 4]);
            const float ra[8] = {a_lo.x, a_lo.y, a_lo.z, a_lo.w, a_hi.x, a_hi.y, a_hi.z, a_hi.w};
            const float rb[8] = {b_lo.x, b_lo.y, b_lo.z, b_lo.w, b_hi.x, b_hi.y, b_hi.z, b_hi.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    acc[i][j] += ra[i] * rb[j];
        }

        if (has_next)
            store_slice(buf ^ 1);  // the other buffer: nobody reads it until the barrier
        __syncthreads();
        buf ^= 1;
    }

#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int row = block_row + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
        if (row >= M)
            continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int col = block_col + h * 64 + tx * 4;
            if (col < N)
                *reinterpret_cast<float4*>(&C[(long long)row * N + col]) =
                    make_float4(acc[i][h * 4 + 0], acc[i][h * 4 + 1], acc[i][h * 4 + 2], acc[i][h * 4 + 3]);
        }
    }
}
