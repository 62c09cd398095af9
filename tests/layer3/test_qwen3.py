"""Qwen3 on random weights against transformers' Qwen3ForCausalLM (CPU, fp32): prefill and
cached decode steps. Qwen3's switches: per-head q/k RMSNorm before RoPE, an explicit
head_dim (here 32, not hidden / heads = 16), no q/k/v bias unless attention_bias."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3

from .test_hf_equivalence import check_against_hf

pytestmark = pytest.mark.usefixtures("single_thread")


def qwen3(tmp_path, **overrides):
    tf = pytest.importorskip("transformers")
    kwargs = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    kwargs.update(overrides)
    torch.manual_seed(0)
    hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(**kwargs)).eval()
    with torch.no_grad():  # norms and biases random too: a dropped q_norm would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    return l3.load(tmp_path, device="cpu", dtype="float32"), hf


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "tie_word_embeddings": True}],
                         ids=["plain", "bias-tied"])
def test_qwen3_matches_transformers(tmp_path, overrides):
    model, hf = qwen3(tmp_path, **overrides)
    c = model.config
    assert c.model_type == "qwen3" and c.qk_norm and c.head_dim == 32
    assert c.qkv_bias == c.o_bias == bool(overrides.get("attention_bias"))
    check_against_hf(model.net, hf)


def test_qwen3_random_model_and_training_path(tmp_path):
    """random_model builds the norms (weight 1); the training forward uses them too."""
    model, hf = qwen3(tmp_path)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.net(ids), hf(ids).logits, atol=2e-4, rtol=1e-4)
    net = l3.random_model(model.config)
    assert torch.equal(net.layers[0].attn.q_norm.weight, torch.ones(32))
