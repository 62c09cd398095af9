// sgemm_06_vectorized.cu -- 16-byte (float4) loads and stores, A's tile transposed.
//
// Row-major float32: A is M x K, B is K x N, C is M x N. REQUIRES K % 4 == 0,
// N % 4 == 0 and 16-byte aligned A, B, C (a float4 must never straddle a row end);
// the host pads other shapes with zeros (see sgemm.py). Any M.
// FLOPs: 2 M N K. Fewest bytes: 4 (M K + K N + M N).
//
// What changed from 05 (same 128 x 128 x 8 tiles, 256 threads, 8 x 8 outputs each):
//
// 1. Global loads are float4: each thread copies its share of a slice with ONE 16-byte
//    load of A and one of B (05: four 4-byte loads of each), so a quarter as many
//    load instructions cross the memory pipeline. C is stored with float4 too.
// 2. A's slice is stored TRANSPOSED in shared memory, As[k][m]. In the inner loop a
//    thread needs 8 values of A from one k and 8 rows; transposed, those are contiguous,
//    so they arrive in two 16-byte shared loads (LDS.128) instead of eight 4-byte ones.
//    Same for B, which is already k-major. 4 shared loads now feed 64 FMAs.
// 3. Each thread's 8 rows (and 8 columns) are two groups of 4: rows ty*4.. and
//    64 + ty*4.. . Neighbouring threads then read neighbouring 16-byte chunks, so a
//    quarter-warp's LDS.128 covers 128 contiguous bytes: no bank conflicts (05's stride-8
//    reads of B had 4-way conflicts). As's rows are padded by 4 floats so that the
//    transposing stores of threads copying different k also land in different banks.
//
// Launch: block 256 (1-D), grid (ceil(N / 128), ceil(M / 128)).

#define BM 128
#define BN 128
#define BK 8
#define PAD 4
#define THREADS 256

extern "C" __global__ void __launch_bounds__(THREADS)
sgemm_vectorized(int M, int N, int K, const float* __restrict__ A,
                 const float* __restrict__ B, float* __restrict__ C)
{
    __shared__ __align__(16) float As[BK][BM + PAD];  // transposed: As[k][m]
    __shared__ __align__(16) float Bs[BK][BN];

    const int tid = threadIdx.x;
    const int block_row = blockIdx.y * BM, block_col = blockIdx.x * BN;
    const int ty = tid / 16, tx = tid % 16;  // owns rows {ty*4, 64+ty*4}+0..3, cols likewise

    // The one float4 of each slice this thread copies.
    const int a_row = tid / 2, a_k = (tid % 2) * 4;    // A slice: 128 rows x 2 float4
    const int b_row = tid / 32, b_col = (tid % 32) * 4; // B slice: 8 rows x 32 float4

    float acc[8][8] = {{0.0f}};

    for (int k0 = 0; k0 < K; k0 += BK) {
        // Out-of-range float4s read as zeros (whole float4s: K and N are multiples of 4).
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (block_row + a_row < M && k0 + a_k < K)
            a = *reinterpret_cast<const float4*>(&A[(long long)(block_row + a_row) * K + k0 + a_k]);
        As[a_k + 0][a_row] = a.x;  // transpose on the way in
        As[a_k + 1][a_row] = a.y;
        As[a_k + 2][a_row] = a.z;
        As[a_k + 3][a_row] = a.w;

        float4 b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (k0 + b_row < K && block_col + b_col < N)
            b = *reinterpret_cast<const float4*>(&B[(long long)(k0 + b_row) * N + block_col + b_col]);
        *reinterpret_cast<float4*>(&Bs[b_row][b_col]) = b;
        __syncthreads();

#pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 a_lo = *reinterpret_cast<const float4*>(&As[k][ty * 4]);
            const float4 a_hi = *reinterpret_cast<const float4*>(&As[k][64 + ty * 4]);
            const float4 b_lo = *reinterpret_cast<const float4*>(&Bs[k][tx * 4]);
            const float4 b_hi = *reinterpret_cast<const float4*>(&Bs[k][64 + tx * 4]);
            const float ra[8] = {a_lo.x, a_lo.y, a_lo.z, a_lo.w, a_hi.x, a_hi.y, a_hi.z, a_hi.w};
            const float rb[8] = {b_lo.x, b_lo.y, b_lo.z, b_lo.w, b_hi.x, b_hi.y, b_hi.z, b_hi.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    acc[i][j] += ra[i] * rb[j];
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int row = block_row + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
        if (row >= M)
            continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int col = block_col + h * 64 + tx * 4;
            if (col < N)  // N % 4 == 0: the whole float4 is inside
                *reinterpret_cast<float4*>(&C[(long long)row * N + col]) =
                    make_float4(acc[i][h * 4 + 0], acc[i][h * 4 + 1], acc[i][h * 4 + 2], acc[i][h * 4 + 3]);
        }
    }
}
