"""The OpenAI-compatible HTTP API: protocol (request bodies), params (-> engine arguments),
render (-> response JSON and chunks), sse (framing, disconnects), errors (OpenAI's error
body), routes (the endpoints), app (create_app)."""
from .app import create_app

__all__ = ["create_app"]
