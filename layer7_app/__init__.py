"""Layer 7 — the application.

- the chat web app (`layer7_app.chat`, `stack chat`): a page in front of a layer-6 server,
  tokens streamed in, Stop, Regenerate, play mode for the course model, stats per reply;
- its store (`layer7_app.store`): sessions, conversations and messages in SQLite;
- RAG over local files (`layer7_app.rag`): BM25 passages cited under the reply;
- the `stack` command-line interface (`layer7_app.cli`), which reaches the layers below
  through the `llm_stack.layers` entry points and never imports a layer directly.

Still to come: the replica router, `stack trace` and lab 7. See README.md.
"""
