"""Layer 6 — serving: the engine behind an OpenAI-compatible HTTP API.

`AsyncEngine` runs one model's engine (layer 5's `LLM`) in a background thread and gives
each request an async stream of deltas (token ids, text that never splits a character nor
leaks a stop string, logprobs, finish reason); leaving a stream aborts its request.
`create_app(engines, api_key=)` is the FastAPI app (/v1/models, /v1/completions,
/v1/chat/completions, /health, /metrics); `start_server(models)` runs it with uvicorn in a
background thread and returns a `ServerHandle` (url, engines, stop()); `serve_main(argv)` is
`stack serve`. (Lab 6's answer key, teaching-size twins of parts of this layer, is
labs/lab6_serving/lab6_reference.py.)
"""
import layer5_parallel as parallel  # the layer beneath, as a namespace: parallel.LLM

from .api import create_app
from .app_thread import AppThread, bind, run_until_interrupted, wait_healthy
from .async_engine import AsyncEngine, EngineOverloaded
from .engine_state import EngineSnapshot, EngineStepError, RequestTimeoutError
from .request_stream import RequestStream
from .server import ServerHandle, serve_main, start_server
from .streams import Delta, RequestMetricsSummary, StreamOutput, TokenLogprob

__all__ = [
    "parallel",
    # the contract layer 7 builds on
    "AsyncEngine", "create_app", "start_server", "ServerHandle", "serve_main",
    # any ASGI app in a uvicorn thread (layer 7's router and trace use it too)
    "AppThread", "bind", "run_until_interrupted", "wait_healthy",
    # what a stream carries, and the engine's state
    "RequestStream", "StreamOutput", "Delta", "TokenLogprob", "RequestMetricsSummary",
    "EngineSnapshot",
    # errors
    "EngineOverloaded", "RequestTimeoutError", "EngineStepError",
]
