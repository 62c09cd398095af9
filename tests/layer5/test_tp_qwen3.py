"""Tensor parallelism on a Qwen3-shaped model: the per-head q/k RMSNorm weight (head_dim,)
is the same for every head, so each rank keeps a full copy (shard_model copies tensors it
does not split) and normalises its own heads; TP=2 must give TP=1's logits."""
from __future__ import annotations

import torch

import layer3_model as l3
import layer5_parallel as l5

from .test_tp_engine import LOGIT_ATOL, random_prompts, run


def test_tp2_qwen3_matches_tp1():
    config = l3.ModelConfig.from_dict({
        "model_type": "qwen3", "vocab_size": 211, "hidden_size": 64, "intermediate_size": 90,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 128})
    net = l3.random_model(config, seed=2, std=0.3)
    with torch.no_grad():  # norms that are not all ones, so a dropped q/k norm would show
        for layer in net.layers:
            layer.attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.attn.k_norm.weight.uniform_(0.5, 1.5)
    model = l3.Model(net)
    prompts = random_prompts(6)
    r1 = run(l5.LLM(model, tensor_parallel_size=1, num_blocks=32, block_size=8), prompts)
    seqs = [i + t for i, t in zip(r1["ids"], r1["tokens"], strict=True)]
    ref = r1["llm"].prompt_logits(seqs)
    with l5.LLM(model, tensor_parallel_size=2, num_blocks=32, block_size=8) as tp:
        logits = tp.prompt_logits(seqs)
    for a, b in zip(ref, logits, strict=True):
        torch.testing.assert_close(b, a, atol=LOGIT_ATOL, rtol=1e-4)
