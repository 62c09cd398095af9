"""Starting the chat app: `stack chat`, and `start_chat` for tests and scripts.

`stack chat` either starts a layer-6 model server in this process (`layer6_serving.start_server`,
the course model unless `--model` says otherwise, on a free port) or uses a running one
(`--server URL`), then serves the chat page on 127.0.0.1 and prints its URL.
"""
from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import Any, NoReturn

import httpx
import uvicorn

from ..rag import DocIndex
from ..store import DEFAULT_DB, Store
from .app import create_chat_app

START_TIMEOUT_S = 30.0


def _bind(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:port (0: any free port); OSError when taken. (Not
    layer6_serving.bind: `stack chat --server URL` must not import torch.)"""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on 127.0.0.1:{port} ({exc.strerror}); "
                      "pick another --port") from exc
    sock.listen(128)
    return sock


class ChatHandle:
    """The chat app running in a background thread; `.url`, `.stop()`, a context manager."""

    def __init__(self, app: Any, port: int = 0) -> None:
        import layer6_serving  # in-process use only, beside a model server (torch is loaded)

        self._http = layer6_serving.AppThread(app, _bind(port), name="chat-app",
                                              start_timeout=START_TIMEOUT_S)
        self.url = self._http.url

    def stop(self) -> None:
        """Stop serving and wait (bounded) for the thread to end."""
        self._http.stop()

    def __enter__(self) -> ChatHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_chat(server_url: str, *, db: Path | str = DEFAULT_DB, docs: Path | str | None = None,
               port: int = 0, api_key: str | None = None) -> ChatHandle:
    """Serve the chat page for the model server at `server_url`; returns a running handle."""
    index = DocIndex.from_dir(docs) if docs is not None else None
    app = create_chat_app(server_url, Store(db), index, api_key=api_key)
    return ChatHandle(app, port)


def _check_server(url: str) -> None:
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=5.0)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise ValueError(f"--server {url}: no OpenAI-compatible server answers there "
                         f"({exc})") from None


class _Parser(argparse.ArgumentParser):
    """argparse, but a user mistake is one line (`error: ...`) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see `stack chat --help`)", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`stack chat` options."""
    ap = _Parser(prog="stack chat", description="Serve the chat web app.")
    ap.add_argument("--model", default=None,
                    help="model to serve in-process (default: the course model)")
    ap.add_argument("--port", type=int, default=8000, help="port of the chat page (default 8000)")
    ap.add_argument("--server", default=None,
                    help="use this running layer-6 server (URL) instead of starting one")
    ap.add_argument("--docs", type=Path, default=None,
                    help="folder of .txt/.md files to answer from (RAG)")
    ap.add_argument("--db", type=Path, default=DEFAULT_DB, help=f"chat database ({DEFAULT_DB})")
    ap.add_argument("--api-key", default=None, help="bearer token of the --server")
    args = ap.parse_args(argv)
    if args.server and args.model:
        ap.error("--model and --server are exclusive: a running server serves its own models")
    if not 0 <= args.port <= 65535:
        ap.error(f"--port must be 0-65535, got {args.port}")
    return args


def main(argv: list[str] | None = None) -> int:
    """`stack chat`: returns an exit code (2 for a user mistake, with a one-line error)."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    model_server = None
    try:
        index = DocIndex.from_dir(args.docs) if args.docs is not None else None
        store = Store(args.db)
        sock = _bind(args.port)
        if args.server:
            _check_server(args.server)
            url = args.server
        else:
            import layer6_serving  # heavy (torch): only when we serve in-process

            print(f"starting the model server ({args.model or 'course'}) ...", flush=True)
            model_server = layer6_serving.start_server(models=(args.model or "course",))
            url = model_server.url
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = create_chat_app(url, store, index, api_key=args.api_key)
    port = sock.getsockname()[1]
    print(f"chat: http://127.0.0.1:{port}  (model server {url}; chats in {store.path})",
          flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        if model_server is not None:
            model_server.stop()
    return 0
