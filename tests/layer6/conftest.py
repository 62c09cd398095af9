"""One course-model server for the layer-6 HTTP tests (127.0.0.1, a free port), and the
offline engine over the same loaded model to compare with."""
from __future__ import annotations

import pytest

import layer6_serving as l6


@pytest.fixture(scope="session")
def server():
    with l6.start_server(["course"], num_blocks=256, max_num_seqs=64) as srv:
        yield srv


@pytest.fixture(scope="session")
def offline(server):
    """layer 5's LLM over the server's loaded model: the offline reference."""
    return l6.parallel.LLM(server.engines["course"].llm.model, num_blocks=64)
