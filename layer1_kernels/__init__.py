"""Layer 1 — kernels (not built yet).

Will hold Triton and CuPy/CUDA C kernels, each beside a torch reference: vector add,
fused softmax, RMSNorm/LayerNorm, RoPE, SiLU-and-multiply, tiled matmul,
FlashAttention-2 forward, weight-only int8 matmul, a shared-memory reduction and an
SGEMM progression, with benchmarks placed on layer 0's measured roofline.
"""
