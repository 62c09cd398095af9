"""`stack serve` and `stack chat --server` as a newcomer runs them: the URL `stack serve`
prints (with /v1) and its --api-key work for `stack chat`, and Ctrl-C ends both cleanly,
with nothing printed after the server's own lines (no interpreter-shutdown noise)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from layer7_app.chat.launch import check_server, default_db

# Stands in for an extension module that reports at interpreter shutdown (nanobind-built
# ones print "nanobind: leaked ..." then): if the process finalizes, this is printed.
# (Only where torch was loaded, as Triton is: not in multiprocessing's resource tracker.)
NOISE = ("import atexit, sys\natexit.register(lambda: 'torch' in sys.modules and "
         "print('nanobind: leaked 1 instances!', file=sys.stderr))\n")


def _stack_script() -> str:
    return shutil.which("stack") or str(Path(sys.executable).with_name("stack"))


def _start(args: list[str], tmp: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([_stack_script(), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _first_line(proc: subprocess.Popen, pattern: str, timeout: float = 120) -> re.Match:
    """The first match of `pattern` in the process's stdout, read line by line (bounded)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    proc.kill()
    raise AssertionError(f"no {pattern!r} in {seen}; stderr {proc.stderr.read()[-2000:]}")


def _interrupt(proc: subprocess.Popen) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def test_serve_url_and_api_key_reach_chat_and_ctrl_c_is_quiet(tmp_path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NOISE)
    env = {k: v for k, v in os.environ.items() if k != "STACK_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path / "site"),
                                                    env.get("PYTHONPATH", "")) if p)
    env["LLM_STACK_CACHE"] = str(tmp_path / "cache")
    serve = _start(["serve", "--port", "0", "--api-key", "K"], tmp_path, env)
    chat = None
    try:
        url = _first_line(serve, r"serving course on (http://\S+/v1)").group(1)
        for given in (url, url + "/", url[:-3]):  # as printed, with a slash, without /v1
            assert check_server(given, "K") == url[:-3]
        with pytest.raises(ValueError, match="pass --api-key"):
            check_server(url)
        with pytest.raises(ValueError, match="refused"):
            check_server(url, "wrong")
        chat = _start(["chat", "--server", url, "--api-key", "K", "--port", "0"], tmp_path, env)
        chat_url = _first_line(chat, r"chat: (http://\S+)").group(1)
        with httpx.Client(base_url=chat_url, timeout=30) as client:
            client.get("/").raise_for_status()  # a session cookie
            models = client.get("/api/models").json()["models"]  # through the key
        assert [m["id"] for m in models] == ["course"]
        code, _, err = _interrupt(chat)
        assert code == 0 and err.strip() == "", err
        assert (tmp_path / "cache" / "chat.db").exists()  # chats beside the cache
    finally:
        if chat is not None and chat.poll() is None:
            chat.kill()
        code, out, err = _interrupt(serve)
    assert code == 0 and err.strip() == "", err
    assert out.strip() == ""  # nothing after the "serving" line


def test_chat_db_follows_llm_stack_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LLM_STACK_CACHE", str(tmp_path))
    assert default_db() == tmp_path / "chat.db"
    monkeypatch.delenv("LLM_STACK_CACHE")
    assert default_db() == Path.home() / ".cache" / "llm-stack" / "chat.db"
