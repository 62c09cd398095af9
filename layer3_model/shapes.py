"""Real models' shapes (config.json contents) for benchmarks with random weights.

Nothing downloads weights: `random_model(ModelConfig.from_dict(LLAMA_3_2_1B))` builds a
network of Llama-3.2-1B's exact shape whose speed is that model's speed (the arithmetic and
the bytes moved do not depend on the values), and every benchmark that uses it says so.
"""
from __future__ import annotations

# meta-llama/Llama-3.2-1B's config.json (the fields this executor reads).
LLAMA_3_2_1B: dict = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
}

SHAPES = {"llama-3.2-1b": LLAMA_3_2_1B}
