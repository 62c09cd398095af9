"""Shared fixtures of layer 2's tests."""
from __future__ import annotations

import pytest

from layer2_comm.launch import START_METHOD_ENV


@pytest.fixture
def fork_server(monkeypatch):
    """launch()'s ranks forked from a server that imported torch once, not each spawned
    afresh (~2 s of CPU a rank): for tests about what ranks compute, not how they start
    (spawn, launch's default, is tested in test_group_launch.py and test_failures.py). CPU
    tests only: the GPU tests keep the default."""
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
