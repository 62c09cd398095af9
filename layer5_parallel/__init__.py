"""Layer 5 — parallelism (not built yet).

Will hold tensor, pipeline, data, expert and sequence parallelism, ZeRO sharding and a
planner that picks a layout for a model and a set of GPUs.
"""
