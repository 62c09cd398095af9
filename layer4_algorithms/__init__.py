"""Layer 4 — system algorithms (not built yet).

Will hold the paged KV cache, prefix caching, continuous batching, chunked prefill,
speculative decoding and CUDA-graph capture of the decode step.
"""
