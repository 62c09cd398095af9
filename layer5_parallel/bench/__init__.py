"""Layer 5's benchmarks and its `stack` commands, apart from the modules that are the system.

commands.py is the CLI entry point (`stack run|bench --layer 5`, `stack plan`); tp.py, pp.py,
dp.py measure the engine's forms against one process; training.py the training forms
(pipeline bubble, DDP overlap, ZeRO memory, checkpointing); expert_context.py and
moe_engine.py expert and context parallelism; timeline.py draws pipelined steps.
"""
