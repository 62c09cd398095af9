"""Layer 4's tooling, apart from the engine it measures: the `stack run/bench --layer 4`
commands (commands.py), the engine workloads and timers (engine.py), the paged decode
kernel against SDPA (paged_attention.py), speculative decoding's speed-up (speculative.py)
and the ratio / roofline annotations every row carries (rows.py).

Nothing in the engine imports this package; it imports the engine.
"""
