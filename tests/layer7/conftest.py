"""Layer-7 fixtures: one real layer-6 model server (the course model) for the whole run.

Starting it loads the model and warms the engine (seconds on a laptop CPU), so every test
that needs replies shares it; each test gets its own chat app and database.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

import layer6_serving
from layer7_app.chat import ChatHandle, start_chat

from .browser_support import CHROMIUM


@pytest.fixture(scope="session")
def model_server() -> Iterator[layer6_serving.ServerHandle]:
    """The course model behind layer 6's OpenAI-compatible API, on a free local port."""
    with layer6_serving.start_server(("course",)) as server:
        yield server


@pytest.fixture()
def chat(model_server: layer6_serving.ServerHandle, tmp_path: Path) -> Iterator[ChatHandle]:
    """A chat app on a fresh database, in front of the shared model server."""
    with start_chat(model_server.url, db=tmp_path / "chat.db") as handle:
        yield handle


@pytest.fixture()
def gauges(model_server: layer6_serving.ServerHandle) -> Callable[[], dict[str, float]]:
    """Reads the course engine's running requests, KV blocks in use and tokens generated
    so far from the model server's Prometheus /metrics."""
    return lambda: engine_gauges(model_server.url)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Headless chromium for a module of browser tests (they carry browser_support's
    BROWSER_MARKS and skip without playwright)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                      args=["--no-sandbox"])
        yield chromium
        chromium.close()


def engine_gauges(server_url: str) -> dict[str, float]:
    """See `gauges`."""
    text = httpx.get(server_url + "/metrics", timeout=10).text
    wanted = {"num_requests_running": "running", "kv_cache_blocks_used": "kv_blocks",
              "generation_tokens_total": "generated"}
    out = {}
    for name, key in wanted.items():
        match = re.search(rf'^llm_stack:{name}{{model_name="course"}} (\S+)$', text, re.M)
        assert match, f"llm_stack:{name} missing from /metrics"
        out[key] = float(match.group(1))
    return out
