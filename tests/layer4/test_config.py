"""EngineConfig: validated once with errors that name the field; LLM(model, config, **overrides)
resolves the model-dependent knobs and hands one object to every part; a subclass with more
fields (layer 5's) and an overridden make_runner pass through."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from layer4_algorithms import LLM, EngineConfig, ModelRunner, SpecConfig

from .l4_helpers import greedy, random_prompts


@pytest.mark.parametrize("field,value", [
    ("backend", "cuda"), ("block_size", 0), ("num_blocks", -1), ("kv_cache_bytes", 0),
    ("gpu_memory_utilization", 1.5), ("max_num_seqs", 0), ("max_num_batched_tokens", 2.5),
    ("max_model_len", 0), ("attn_bytes_limit", 0), ("enable_prefix_caching", "yes"),
    ("cuda_graph", 1), ("scheduling", "lottery"), ("grammar_fill_threads", 0),
    ("grammar_fill_threads", 10**9), ("prefill_attention", "fa3"),
])
def test_a_bad_value_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field if field != "scheduling" else "policy"):
        EngineConfig(**{field: value})


def test_speculative_accepts_a_dict_and_checks_it():
    config = EngineConfig(speculative={"method": "ngram", "k": 2})
    assert config.speculative == SpecConfig("ngram", 2)
    with pytest.raises(ValueError, match="speculative k"):
        EngineConfig(speculative={"k": 0})
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_blocks=4, kv_cache_bytes=10**6)


def test_llm_resolves_the_config_and_shares_it(tiny_model):
    base = EngineConfig(block_size=4, num_blocks=32)
    llm = LLM(tiny_model, base, max_num_seqs=3)
    assert base.max_num_seqs == 256  # the caller's object is not changed
    cfg = llm.config
    assert (cfg.max_num_seqs, cfg.num_blocks, cfg.block_size) == (3, 32, 4)
    assert cfg.max_model_len == tiny_model.config.max_position_embeddings
    assert llm.scheduler.config is cfg and llm.runner.config is cfg
    assert llm.block_manager.num_blocks == 32 and llm.cache.block_size == 4
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny_model, max_num_seq=3)


def test_a_subclass_config_and_runner_pass_through(tiny_model):
    @dataclass
    class WideConfig(EngineConfig):
        tensor_parallel_size: int = 1

    built = []

    class CountingLLM(LLM):
        def make_runner(self) -> ModelRunner:
            built.append(self.config)
            return ModelRunner(self.model.net, self.cache, self.config)

    llm = CountingLLM(tiny_model, WideConfig(tensor_parallel_size=2), block_size=4, num_blocks=64)
    assert isinstance(llm.config, WideConfig) and llm.config.tensor_parallel_size == 2
    assert built == [llm.config]
    prompts = random_prompts([5, 9], seed=3)
    outs = llm.generate(prompts, greedy(6))
    want = [o.token_ids for o in tiny_model.generate_outputs(prompts, greedy(6))]
    assert [o.outputs[0].token_ids for o in outs] == want


def test_prefill_attention_cudnn_is_refused_where_it_cannot_run(tiny_model):
    """The default leaves the network's flash path; "cudnn" is set on the network by LLM,
    which refuses it, naming the problem, on the torch backend and off CUDA (and leaves the
    network as it was)."""
    assert LLM(tiny_model, num_blocks=32).model.net.prefill_attention == "flash"
    with pytest.raises(ValueError, match="needs the model on a CUDA GPU|needs the triton"):
        LLM(tiny_model, num_blocks=32, prefill_attention="cudnn")
    assert tiny_model.net.prefill_attention == "flash" and tiny_model.net.backend == "torch"
    # None: cuDNN where it works, else flash (here: a CPU model on the torch backend)
    llm = LLM(tiny_model, num_blocks=32, prefill_attention=None)
    assert llm.config.prefill_attention == "flash" == tiny_model.net.prefill_attention
