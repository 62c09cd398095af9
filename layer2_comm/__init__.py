"""Layer 2 — communication (not built yet).

Will hold process groups (NCCL on GPUs, gloo on CPUs), collectives built from
send/recv (ring and tree all-reduce, all-gather, reduce-scatter, broadcast, all-to-all,
hierarchical all-reduce), an alpha-beta cost model and an nccl-tests-style benchmark.
"""
