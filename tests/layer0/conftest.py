"""CPU matmuls at a small size where a test measures ceilings through the commands
(tests/small_matmuls.py). The lab 0 notebook (tests/labs/test_notebooks.py) still measures
them at the quick plan's own sizes."""
from __future__ import annotations

import pytest

from tests.small_matmuls import patch_small_matmuls


@pytest.fixture
def small_cpu_matmuls(monkeypatch):
    """Every ceiling measured as before, through the same code, with the CPU matmuls small."""
    patch_small_matmuls(monkeypatch)
