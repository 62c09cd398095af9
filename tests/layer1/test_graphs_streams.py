"""CUDA graphs and streams demos: right answers and sane timings on a GPU, a clear error without."""
from __future__ import annotations

import math

import pytest
import torch

from layer1_kernels.graphs_streams import cuda_graph_demo, stream_overlap_demo

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present here")


@no_cuda
@pytest.mark.parametrize("demo", [cuda_graph_demo, stream_overlap_demo])
def test_clear_error_without_cuda(demo) -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        demo()


@pytest.mark.parametrize("call", [lambda: cuda_graph_demo(n_launches=0),
                                  lambda: stream_overlap_demo(copy_mb=0)])
def test_bad_arguments(call) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        call()


@pytest.mark.gpu
def test_cuda_graph_demo() -> None:
    r = cuda_graph_demo(n_launches=300, size=4096)
    assert r["results_match"] is True
    assert r["n_launches"] == 301
    assert r["eager_ms"] > 0 and r["graph_ms"] > 0
    assert math.isclose(r["eager_us_per_launch"] - r["graph_us_per_launch"], r["saved_us_per_launch"],
                        rel_tol=1e-6, abs_tol=1e-9)
    assert math.isclose(r["speedup"], r["eager_ms"] / r["graph_ms"])


@pytest.mark.gpu
def test_stream_overlap_demo() -> None:
    r = stream_overlap_demo(copy_mb=64, matmul_n=2048, repeats=3)
    assert r["results_match"] is True
    assert 1 <= r["n_matmuls"] <= 64
    for key in ("copy_ms", "compute_ms", "serial_ms", "overlapped_ms", "copy_gb_per_s"):
        assert r[key] > 0 and math.isfinite(r[key]), key
    expected = (r["serial_ms"] - r["overlapped_ms"]) / min(r["copy_ms"], r["compute_ms"])
    assert math.isclose(r["overlap_efficiency"], expected)
    assert r["overlap_efficiency"] < 1.5  # at most the shorter one can be hidden (plus noise)
