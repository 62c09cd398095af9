"""Layer 7 — the application.

- the chat web app (`layer7_app.chat`, `stack chat`): a page in front of a layer-6 server,
  tokens streamed in, Stop, Regenerate, play mode for the course model, stats per reply;
- its store (`layer7_app.store`): sessions, conversations and messages in SQLite;
- RAG over local files (`layer7_app.rag`): BM25 passages cited under the reply;
- the replica router (`layer7_app.router`, `stack route`): an OpenAI-compatible proxy with
  round_robin / least_loaded / prefix_aware policies, health checks, failover, autoscaling;
- request tracing (`layer7_app.trace`, `stack trace "prompt"`): one request's spans from the
  router down to the kernels, as a Perfetto JSON and a table of time per layer;
- the `stack` command-line interface (`layer7_app.cli`), which reaches the layers below
  through the `llm_stack.layers` entry points and never imports a layer directly.

See README.md for the path one message takes through the stack.
"""
