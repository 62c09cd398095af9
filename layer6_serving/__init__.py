"""Layer 6 — serving (not built yet).

Will hold the async engine, a token-level scheduler, the OpenAI-compatible HTTP API,
Prometheus metrics and a load generator.
"""
