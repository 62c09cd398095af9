"""Shared fixtures for layer 4: a tiny random Llama (token-id prompts, no tokenizer) and the
course target and draft models (text, stop strings; `target` is `course_model`). Greedy
comparisons against layer 3 need clear argmax margins, so the tiny model's weights are drawn
large (std 0.3): rounding differences between the paged and the contiguous path (different
padding, chunking) cannot flip a token."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3

from .l4_helpers import TINY


@pytest.fixture(scope="session")
def tiny_model() -> l3.Model:
    return l3.Model(l3.random_model(l3.ModelConfig.from_dict(TINY), seed=0, std=0.3), None)


@pytest.fixture(scope="module")
def cuda_model() -> l3.Model:
    """The tiny model on the GPU (the GPU tests only)."""
    return l3.Model(l3.random_model(l3.ModelConfig.from_dict(TINY), seed=0, std=0.3, device="cuda"),
                    None)


@pytest.fixture(scope="module")
def cuda_triton_model() -> l3.Model:
    """The tiny model on the GPU on the triton backend (flash attention: prefill graphs work)."""
    return l3.Model(l3.random_model(l3.ModelConfig.from_dict(TINY), seed=0, std=0.3, device="cuda",
                                    backend="triton"), None)


@pytest.fixture(scope="session")
def course_model() -> l3.Model:
    return l3.load(l3.course_model_dir("target"), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def target(course_model: l3.Model) -> l3.Model:
    """The course target model, as the speculative-decoding tests call it."""
    return course_model


@pytest.fixture(scope="session")
def draft() -> l3.Model:
    """The course draft model (speculative decoding's proposer)."""
    return l3.load(l3.course_model_dir("draft"), device="cpu", dtype="float32")


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny matmuls: one intra-op thread is faster and immune to the other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
