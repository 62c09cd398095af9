"""What one request may ask of the server: body size, string and list sizes, clean unicode.

A client must not be able to make the server do unbounded work before it is refused:

  body size     `BodyLimit` (ASGI middleware) answers 413 from the Content-Length header,
                before a byte of the body is read, and counts the bytes of a body sent
                without one (chunked), refusing it once it passes the limit. Default 4 MiB:
                far above any prompt a context holds, far below what hurts the server.
  fields        every string and list a request carries has a bound (protocol.py uses the
                types below): stop strings (count and length) are checked on every token,
                so an unbounded list slows every request that shares the engine.
  unicode       JSON may carry lone surrogates ("\\udfff"), which are not text: no tokenizer
                takes them and no UTF-8 encoder writes them. `Text` refuses them with a 400
                naming the field, on every field that is read (the model name included).
  prompt size   a text prompt longer than the context could hold even in the longest tokens
                the vocabulary has is refused before it is tokenized (AsyncEngine.check_chars).
"""
from __future__ import annotations

from typing import Annotated

from fastapi import HTTPException
from pydantic import AfterValidator, Field

from .errors import OpenAIError

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_STOP = 16            # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256     # characters per stop string
MAX_NAME_CHARS = 256     # model, message names, user
MAX_MESSAGES = 2048      # chat messages per request
MAX_BATCH = 64           # prompts per completions request


def no_surrogates(s: str) -> str:
    """s unchanged, or ValueError when it holds a lone surrogate (not encodable as UTF-8)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid unicode: lone surrogate {s[e.start]!r} at character "
                         f"{e.start}") from None
    return s


Text = Annotated[str, AfterValidator(no_surrogates)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(no_surrogates)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(no_surrogates)]


class BodyLimit:
    """ASGI middleware: POST/PUT/PATCH bodies over max_bytes get a 413 in OpenAI's shape."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: str) -> OpenAIError:
        return OpenAIError(413, f"the request body is {size}; this server takes at most "
                           f"{self.max_bytes} bytes (--max-body-bytes)", code="body_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                return await _send(OpenAIError(400, "invalid Content-Length header",
                                               code="invalid_request"), scope, receive, send)
            if n > self.max_bytes:
                return await _send(self._too_large(f"{n} bytes"), scope, receive, send)
            return await self.app(scope, receive, send)
        seen = 0
        started = False

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(413, self._too_large(f"over {self.max_bytes} bytes").message)
            return msg

        async def watched_send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted, watched_send)
        except _TooLarge:
            if not started:
                await _send(self._too_large(f"over {self.max_bytes} bytes"), scope, receive,
                            send)


class _TooLarge(HTTPException):
    """Raised from inside the body read: FastAPI lets an HTTPException through as it is."""


async def _send(err: OpenAIError, scope, receive, send) -> None:
    # the client may still be sending: the connection closes after this answer
    await err.response(close=True)(scope, receive, send)
