"""Layer 1 — kernels: the GPU programs a serving system spends its time in.

Each kernel sits beside a torch reference (`<name>_reference`) and dispatches by device:
`impl="auto"` runs our kernel on CUDA tensors and the reference on CPU tensors;
`impl="triton"` forces our Triton kernel (through Triton's interpreter on a CPU — how
the tests check it without a GPU); `impl="torch"` forces the reference.

Triton kernels: vector add, fused row softmax (online max/sum), RMSNorm/LayerNorm with a
fused residual add, RoPE on q and k in one pass, SiLU-and-multiply, a grouped, autotuned
matmul (bf16/fp16/fp32, fp8 on Hopper), FlashAttention-2 forward (causal, GQA; one sequence,
or many of different lengths in one launch, over packed rows or a paged cache; cuDNN's
fused attention beside it, `cudnn_attention_tokens`, as an opt-in for a lone prompt) and a
weight-only int8 matmul (W8A16); for decode, skinny GEMVs with RMSNorm or SiLU-and-multiply
fused into their prologue, RoPE fused with the KV-cache write, and split-context (flash-
decoding) attention over a paged or contiguous cache.
CuPy / CUDA C kernels (need a CUDA GPU): a shared-memory + warp-shuffle reduction, an
ElementwiseKernel and a ReductionKernel, and an SGEMM progression from naive to
vectorized, double-buffered tiles. Plus CUDA graphs and streams demonstrations.

The layer beneath is `hardware` (layer 0, as a namespace). Layer 0's tools that every layer
above uses (timing, ceilings, datasheets, the results directory, system info, the CLI's error
wrapper) are re-exported here by name, and each layer above passes them on the same way, so no
layer reaches them through a chain of namespaces.
"""
import layer0_hardware as hardware  # the layer beneath, as a namespace for the layers above

from . import interpreter  # noqa: F401  (first: sets TRITON_INTERPRET on a machine without CUDA)
from .argmax import argmax, argmax_reference
from .cudnn_attention import cudnn_attention_tokens
from .cupy_support import cupy_available
from .env import env_switch
from .flash_attention import flash_attention, flash_attention_reference, flash_attention_tokens
from .flash_attention_varlen import flash_attention_varlen, flash_attention_varlen_reference
from .gemv import TUNED as GEMV_TUNED
from .gemv import (
    gemv,
    gemv_reference,
    gemv_rms_norm,
    gemv_rms_norm_reference,
    gemv_silu_mul,
    gemv_silu_mul_reference,
)
from .gemv import set_pdl as set_decode_pdl
from .gemv_parts import GEMV_PARTS
from .gemv_rope import (
    gemv_rms_norm_rope,
    gemv_rms_norm_rope_reference,
)
from .graphs_streams import cuda_graph_demo, stream_overlap_demo
from .int8_matmul import int8_matmul, int8_matmul_reference, quantize_int8
from .interpreter import INTERPRETED, kernel_device, refuse_interpreted_bf16_dot, use_triton
from .matmul import matmul, matmul_reference
from .matmul_fp8 import matmul_fp8, matmul_fp8_reference
from .norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from .nvcc import compile_check, nvcc_available
from .paged_decode import paged_decode, paged_decode_splits
from .reduction import (
    cupy_row_rms,
    cupy_row_rms_reference,
    cupy_silu_mul,
    cupy_silu_mul_reference,
    reduce_sum,
    reduce_sum_reference,
)
from .rope import apply_rope, rope_cache, rope_reference
from .rope_kv_write import rope_cache_write, rope_cache_write_reference
from .sgemm import SGEMM_VERSIONS, sgemm, sgemm_reference, sgemm_source
from .skinny_matmul import (
    skinny_linear,
    skinny_matmul,
    skinny_matmul_reference,
)
from .softmax import softmax, softmax_reference
from .swiglu import silu_and_mul, silu_and_mul_reference
from .vector_add import vector_add, vector_add_reference

# layer 0's tools (timing, ceilings, datasheets, results, the CLI wrapper), passed up by name
time_fn, Timing = hardware.time_fn, hardware.Timing
load_ceilings, Ceilings = hardware.load_ceilings, hardware.Ceilings
DATASHEETS, system_info = hardware.DATASHEETS, hardware.system_info
results_dir, run_command = hardware.results_dir, hardware.run_command

__all__ = [
    # where kernels run
    "INTERPRETED", "kernel_device", "use_triton", "refuse_interpreted_bf16_dot",
    "cupy_available", "nvcc_available", "compile_check",
    # the kernels' measured options, switched from the environment
    "env_switch",
    # Triton kernels and their references
    "vector_add", "vector_add_reference",
    "softmax", "softmax_reference",
    "rms_norm", "rms_norm_reference", "layer_norm", "layer_norm_reference",
    "rope_cache", "apply_rope", "rope_reference",
    "silu_and_mul", "silu_and_mul_reference",
    "matmul", "matmul_reference", "matmul_fp8", "matmul_fp8_reference",
    "flash_attention", "flash_attention_reference", "flash_attention_tokens",
    "flash_attention_varlen", "flash_attention_varlen_reference",
    # the library kernel beside them: cuDNN's fused attention (one sequence, token-major)
    "cudnn_attention_tokens",
    "int8_matmul", "int8_matmul_reference", "quantize_int8",
    # decode: skinny products with fused prologues, RoPE + cache write, split decode attention
    "gemv", "gemv_reference", "GEMV_TUNED", "set_decode_pdl", "GEMV_PARTS",
    "gemv_rms_norm", "gemv_rms_norm_reference",
    "gemv_rms_norm_rope", "gemv_rms_norm_rope_reference",
    "gemv_silu_mul", "gemv_silu_mul_reference", "rope_cache_write", "rope_cache_write_reference",
    "paged_decode", "paged_decode_splits", "argmax", "argmax_reference",
    # decode batches: products of up to 256 rows (cuBLAS except where measured slower)
    "skinny_matmul", "skinny_matmul_reference", "skinny_linear",
    # CuPy / CUDA C kernels
    "reduce_sum", "reduce_sum_reference",
    "cupy_silu_mul", "cupy_silu_mul_reference", "cupy_row_rms", "cupy_row_rms_reference",
    "sgemm", "sgemm_reference", "sgemm_source", "SGEMM_VERSIONS",
    # CUDA graphs and streams
    "cuda_graph_demo", "stream_overlap_demo",
    # the layer beneath (layer 0), as a namespace, and its tools passed up by name
    "hardware",
    "time_fn", "Timing", "load_ceilings", "Ceilings", "DATASHEETS", "results_dir", "system_info",
    "run_command",
]
