// sgemm_01_naive.cu -- C = A @ B, one thread per element of C (the starting point).
//
// Row-major float32: A is M x K, B is K x N, C is M x N; any M, N, K.
// FLOPs: 2 M N K. Fewest bytes: 4 (M K + K N + M N).
//
// Each thread computes one C[row][col] as a dot product of a row of A and a column of B,
// reading both straight from global memory: 2 K loads for 2 K FLOPs, so even with
// perfect caching this version is limited by how fast loads can be issued, not by math.
//
// Worse, the thread -> element mapping is the "wrong" way round on purpose:
// threadIdx.x (the index that varies fastest within a warp) walks down the ROWS of C.
// At each step k, the 32 threads of a warp therefore read A[row..row+31][k] -- 32 floats
// K apart, 32 separate memory transactions where one would do -- and they store C
// column-wise, N floats apart. Compare sgemm_02_coalesced.cu, which changes only the
// mapping.
//
// Launch: block (32, 32), grid (ceil(M / 32), ceil(N / 32)).

extern "C" __global__ void sgemm_naive(int M, int N, int K, const float* __restrict__ A,
                                       const float* __restrict__ B, float* __restrict__ C)
{
    const int row = blockIdx.x * blockDim.x + threadIdx.x;  // fastest index -> rows: uncoalesced
    const int col = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N)
        return;  // the edge blocks hang over the matrix when M or N is not a multiple of 32

    float acc = 0.0f;
    for (int k = 0; k < K; ++k)
        acc += A[(long long)row * K + k] * B[(long long)k * N + col];
    C[(long long)row * N + col] = acc;
}
