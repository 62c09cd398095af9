// sgemm_05_blocktile_2d.cu -- each thread computes a TM x TN = 8 x 8 block of outputs.
//
// Row-major float32: A is M x K, B is K x N, C is M x N; any M, N, K.
// FLOPs: 2 M N K. Fewest bytes: 4 (M K + K N + M N).
//
// What changed from 04: the tile grows to BM x BN = 128 x 128 per block of 256 threads,
// and each thread owns an 8 x 8 square of outputs (64 accumulators in registers). For
// each k of a BK = 8 slice, a thread loads 8 values of A (a column strip) and 8 of B (a
// row strip) from shared memory into registers and does their OUTER PRODUCT: 64 FMAs for
// 16 shared loads, 4 FMAs per load against 04's ~1. A thread's registers now hold
// 64 + 16 floats, which is why the block is smaller in threads than in outputs.
// Global traffic per FMA also halves again: a 128 x 128 tile reads 256 values per k
// for 16384 FMAs (04: 128 values for 4096).
//
// Each thread copies 4 values of the A slice (128 x 8) and 4 of the B slice (8 x 128)
// per step, one float at a time. What is left to gain (sgemm_06): 16-byte loads and
// stores, and conflict-free shared-memory reads -- here the 16 different thread columns
// of a warp read B at stride TN = 8 words, so 4 of them share a bank (4-way conflict).
// Launch: block 256 (1-D), grid (ceil(N / 128), ceil(M / 128)).

#define BM 128
#define BN 128
#define BK 8
#define TM 8
#define TN 8
#define THREADS ((BM / TM) * (BN / TN))  // 256

// Copy the ROWS x COLS slice at (row0, col0) of a row-major rows x cols matrix into shared
// memory, zeros past the matrix's edges: thread tid copies the slice's elements tid,
// tid + THREADS, ... (in row-major order), (ROWS * COLS) / THREADS of them.
template <int ROWS, int COLS>
__device__ __forceinline__ void copy_slice(float (&dst)[ROWS][COLS],
                                           const float* __restrict__ src, int rows, int cols,
                                           int row0, int col0, int tid)
{
#pragma unroll
    for (int r = 0; r < (ROWS * COLS) / THREADS; ++r) {
        const int idx = tid + r * THREADS;
        const int sr = idx / COLS, sc = idx % COLS;
        const int gr = row0 + sr, gc = col0 + sc;
        dst[sr][sc] = (gr < rows && gc < cols) ? src[(long long)gr * cols + gc] : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
sgemm_blocktile_2d(int M, int N, int K, const float* __restrict__ A,
                   const float* __restrict__ B, float* __restrict__ C)
{
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];

    const int tid = threadIdx.x;
    const int block_row = blockIdx.y * BM, block_col = blockIdx.x * BN;
    const int thread_row = tid / (BN / TN);  // 0..15: rows thread_row*TM ..
    const int thread_col = tid % (BN / TN);  // 0..15: cols thread_col*TN ..

    float acc[TM][TN] = {{0.0f}};
    float reg_a[TM], reg_b[TN];

    for (int k0 = 0; k0 < K; k0 += BK) {
        // Copy the slices: 1024 values each, 4 per thread; consecutive threads read
        // consecutive addresses (8 apart in A's rows, 128 in B's).
        copy_slice<BM, BK>(As, A, M, K, block_row, k0, tid);
        copy_slice<BK, BN>(Bs, B, K, N, k0, block_col, tid);
        __syncthreads();

#pragma unroll
        for (int k = 0; k < BK; ++k) {
#pragma unroll
            for (int i = 0; i < TM; ++i)
                reg_a[i] = As[thread_row * TM + i][k];
#pragma unroll
            for (int j = 0; j < TN; ++j)
                reg_b[j] = Bs[k][thread_col * TN + j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j)
                    acc[i][j] += reg_a[i] * reg_b[j];  // outer product: 64 FMAs, 16 loads
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = block_row + thread_row * TM + i;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int col = block_col + thread_col * TN + j;
            if (row < M && col < N)
                C[(long long)row * N + col] = acc[i][j];
        }
    }
}
