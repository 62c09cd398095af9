"""A pipeline stage's decode micro-batches through its graph runner (pipeline_parallel/graphs.py),
in one process, no ranks: stages chained through their StageGraphRunners give the model's own
decode logits, micro-batch by micro-batch, padding rows included (3 + 2 rows into buckets of 4
and 2). On a CPU the static buffers run uncaptured; on a GPU the graphs are captured and
replayed (one GPU is enough: this is what every PP rank does with its stage)."""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.pipeline_parallel import stage as pp_stage
from layer5_parallel.pipeline_parallel.graphs import StageGraphRunner

l3 = l5.engine.executor


def config() -> l3.ModelConfig:
    return l3.ModelConfig(model_type="llama", vocab_size=211, hidden_size=64,
                          intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_stage_graphs_chained_equal_the_model(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    net = l3.random_model(config(), seed=5, std=0.3).to(device)
    net.init_rope(device)
    blocks, bs = 16, 4
    full = l5.engine.PagedKVCache.for_model(net.config, blocks, bs, dtype=torch.float32,
                                            device=device)
    stages = [pp_stage.StageNet(net, s, 2) for s in range(2)]
    caches = [pp_stage.StageKVCache.for_stage(s, blocks, bs) for s in stages]
    graphs = [StageGraphRunner(s, c, 8, 16, capture=device == "cuda")
              for s, c in zip(stages, caches, strict=True)]
    assert graphs[0].buckets == [1, 2, 4, 8]
    tables = [[0, 1], [2, 3, 8], [4], [5, 6], [7]]
    prompt_lens = [6, 8, 3, 5, 2]
    ids = (torch.arange(sum(prompt_lens), device=device) * 7) % 211
    ctx = full.context(prompt_lens, [0] * 5, tables)
    net(ids, ctx, full, last_only=True)  # the prefill: every cache holds the prompts' keys
    x = ids
    for stage, cache in zip(stages, caches, strict=True):
        x = stage(x, ctx, cache, last_only=True)
    new = torch.tensor([5, 9, 11, 13, 17], device=device)
    dctx = full.context([1] * 5, prompt_lens, tables)
    want = net(new, dctx, full, last_only=True)
    cuts = pp_stage.micro_batches(dctx.query_lens_host, 2)  # 3 + 2 sequences
    parts = pp_stage.micro_contexts(dctx.query_lens_host, dctx.seq_lens_host, dctx.slot_mapping,
                                    dctx.block_tables, cuts, torch.device(device))
    rows = []
    for t0, t1, mctx, _ in parts:
        x = new[t0:t1]
        for g, cache in zip(graphs, caches, strict=True):
            assert g.applies(mctx, cache)
            x = g.run_micro(x, mctx)
        rows.append(x)
    assert [g.replays for g in graphs] == [2, 2]
    torch.testing.assert_close(torch.cat(rows).float(), want, atol=1e-4, rtol=0)
    assert not graphs[0].applies(ctx, caches[0])  # a prefill runs the stage eagerly
