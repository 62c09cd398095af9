"""Shared fixtures for layer 4: a tiny random Llama (token-id prompts, no tokenizer) and the
course model (text, stop strings). Greedy comparisons against layer 3 need clear argmax
margins, so the tiny model's weights are drawn large (std 0.3): rounding differences between
the paged and the contiguous path (different padding, chunking) cannot flip a token."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3

TINY = dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=1)


@pytest.fixture(scope="session")
def tiny_model() -> l3.Model:
    return l3.Model(l3.random_model(l3.ModelConfig.from_dict(TINY), seed=0, std=0.3), None)


@pytest.fixture(scope="session")
def course_model() -> l3.Model:
    return l3.load(l3.course_model_dir("target"), device="cpu", dtype="float32")


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny matmuls: one intra-op thread is faster and immune to the other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
