// sgemm_03_smem_tiled.cu -- 32 x 32 tiles staged through shared memory.
//
// Row-major float32: A is M x K, B is K x N, C is M x N; any M, N, K.
// FLOPs: 2 M N K. Fewest bytes: 4 (M K + K N + M N).
//
// What changed from 02: a block of 32 x 32 threads computes a 32 x 32 tile of C, walking
// K in steps of 32. At each step the block copies a 32 x 32 tile of A and one of B from
// global into shared memory (each thread one element of each, coalesced), waits at a
// barrier, and then every thread runs its 32-long dot product out of shared memory.
// Each element brought in from global memory is now used 32 times (by the 32 threads of
// its row or column), so global traffic falls 32x. The second __syncthreads stops a fast
// warp from overwriting a tile that slower warps are still reading.
//
// Shared-memory reads: As[ty][k] is one address per warp (broadcast); Bs[k][tx] is 32
// consecutive words, one per bank, so neither read has bank conflicts. What limits this
// version now is the ratio of shared-memory loads to FMAs: 2 loads per FMA. sgemm_04
// reuses values from registers to lower it.
//
// Tiles that hang over the matrix edge are filled with zeros, which add nothing.
// Launch: block (32, 32), grid (ceil(N / 32), ceil(M / 32)).

#define TILE 32

extern "C" __global__ void sgemm_smem_tiled(int M, int N, int K, const float* __restrict__ A,
                                            const float* __restrict__ B, float* __restrict__ C)
{
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];

    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty;
    const int col = blockIdx.x * TILE + tx;

    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        // Cooperative, coalesced copy of one tile of A and one of B (zeros past the edges).
        As[ty][tx] = (row < M && k0 + tx < K) ? A[(long long)row * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(long long)(k0 + ty) * N + col] : 0.0f;
        __syncthreads();  // the tiles are complete before anyone reads them

#pragma unroll
        for (int k = 0; k < TILE; ++k)
            acc += As[ty][k] * Bs[k][tx];
        __syncthreads();  // everyone is done reading before the next copy overwrites them
    }
    if (row < M && col < N)
        C[(long long)row * N + col] = acc;
}
