"""Layer 7 — the application.

Built so far: the `stack` command-line interface (`layer7_app.cli`), which reaches every
layer through the `llm_stack.layers` entry points and never imports a layer directly.

Still to come: the chat web app, sessions, RAG and the replica router.
"""
