"""Starting the chat app: `stack chat`, and `start_chat` for tests and scripts.

`stack chat` either starts a layer-6 model server in this process (`layer6_serving.start_server`,
the course model unless `--model` says otherwise, on a free port) or uses a running one
(`--server URL`), then serves the chat page on 127.0.0.1 and prints its URL.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any, NoReturn

import httpx
import uvicorn

from ..rag import DocIndex
from ..store import Store
from .app import create_chat_app
from .upstream import server_root

START_TIMEOUT_S = 30.0


def default_db() -> Path:
    """Where chats are kept: `$LLM_STACK_CACHE/chat.db` (beside the models), else
    `~/.cache/llm-stack/chat.db`."""
    root = os.environ.get("LLM_STACK_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "llm-stack") / "chat.db"


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


def start_chat(server_url: str, *, db: Path | str | None = None, docs: Path | str | None = None,
               port: int = 0, api_key: str | None = None) -> ChatHandle:
    """Serve the chat page for the model server at `server_url`; returns a running handle."""
    index = DocIndex.from_dir(docs) if docs is not None else None
    app = create_chat_app(server_url, Store(default_db() if db is None else db), index,
                          api_key=api_key)
    return ChatHandle(app, port)


def check_server(url: str, api_key: str | None = None) -> str:
    """The server's root URL (`url` with or without /v1, as `stack serve` prints it), once
    its /v1/models answers with `api_key`; ValueError saying what went wrong otherwise."""
    root = server_root(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(root + "/v1/models", timeout=5.0, headers=headers)
    except httpx.HTTPError as exc:
        raise ValueError(f"--server {url}: no OpenAI-compatible server answers there "
                         f"({exc})") from None
    if resp.status_code == 401:
        raise ValueError(f"--server {url} wants an API key: "
                         + ("--api-key was refused" if api_key else "pass --api-key KEY"))
    if resp.status_code != 200 or "data" not in _json(resp):
        raise ValueError(f"--server {url}: no OpenAI-compatible server answers there "
                         f"(GET {root}/v1/models: HTTP {resp.status_code})")
    return root


def _json(resp: httpx.Response) -> dict:
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


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
    ap.add_argument("--db", type=Path, default=None,
                    help="chat database (default $LLM_STACK_CACHE/chat.db, else "
                         "~/.cache/llm-stack/chat.db)")
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
        store = Store(default_db() if args.db is None else args.db)
        sock = _bind(args.port)
        if args.server:
            url = check_server(args.server, args.api_key)
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
        # uvicorn shuts down on Ctrl-C, then raises the signal again for its caller: that is
        # how a user stops the page, so it ends here, with exit code 0. A browser tab left
        # open holds its connections (a reply still streaming): they get 2 s, then close,
        # so Ctrl-C never waits on a tab.
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
                       ).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        if model_server is not None:
            model_server.stop()
    return 0
