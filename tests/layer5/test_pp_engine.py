"""Pipeline parallelism through the engine: PP=2 and PP=3 greedy output equals PP=1.

A random qwen2-shaped model with 5 layers (cut 3+2 and 2+2+1) and kv_heads=2, gloo stages on
the CPU, fp32. The workload makes layer 4 do everything it does: 16 prompts sharing a prefix
(prefix caching), a KV pool too small for them all (preemption), a request with n=2 (its
children share blocks: copy-on-write, forwarded to every stage), run twice (the second run
hits the prefix cache). Micro-batches give a stage a different number of rows per matmul than
one process, so a token may differ only where PP=1's own top two logits nearly tie (shown by
the margin); logits of prompt + completion, one prefill through the stages, within 1e-4.
"""
from __future__ import annotations

import multiprocessing
from dataclasses import replace

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.bench import commands
from layer5_parallel.pipeline_parallel import stage as pp_stage

from .engine_checks import assert_same_or_near_tie_at

l3 = l5.engine.executor

MAX_TOKENS = 8
LOGIT_ATOL = 1e-4
ENGINE = dict(num_blocks=40, block_size=4, max_num_seqs=16)


def random_config(layers: int = 5) -> l3.ModelConfig:
    return l3.ModelConfig(model_type="qwen2", vocab_size=211, hidden_size=64, intermediate_size=90,
                          num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=8, qkv_bias=True, max_position_embeddings=128)


def prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    """A shared 9-token prefix (two whole blocks of 4 and one more) then 2..15 own tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 211, (9,), generator=g).tolist()
    lens = torch.randint(2, 16, (n,), generator=g).tolist()
    return [prefix + torch.randint(0, 211, (k,), generator=g).tolist() for k in lens]


def run(llm) -> dict:
    ps = prompts()
    params = [l5.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                n=2 if i == 3 else 1) for i in range(len(ps))]
    first = llm.generate(ps, params)
    stats = llm.stats
    again = llm.generate(ps, params)
    tokens = [[c.token_ids for c in o.outputs] for o in first]
    assert tokens == [[c.token_ids for c in o.outputs] for o in again]  # each engine agrees
    seqs = [p + t[0] for p, t in zip(ps, tokens, strict=True)]
    return {"ids": ps, "tokens": tokens, "stats": stats, "again": llm.stats, "llm": llm,
            "logits": llm.prompt_logits(seqs)}


@pytest.fixture(scope="module")
def model() -> l3.Model:
    return l3.Model(l3.random_model(random_config(), seed=1, std=0.3))


@pytest.fixture(scope="module")
def ref(model):
    return run(l5.LLM(model, **ENGINE))


@pytest.fixture(scope="module", params=[2, 3])
def pp(request, model):
    with l5.LLM(model, pipeline_parallel_size=request.param, **ENGINE) as llm:
        out = run(llm)
        out["memory"] = llm.rank_memory()
        out["busy"] = llm.runner.net.stage_busy()
        yield out
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]


def assert_same_or_near_tie(ref: dict, pp: dict) -> None:
    """Every completion of every prompt (n > 1: several per prompt) equal to PP=1's or
    first differing at a near-tie."""
    for i, (a, b) in enumerate(zip(ref["tokens"], pp["tokens"], strict=True)):
        for x, y in zip(a, b, strict=True):
            assert_same_or_near_tie_at(ref["llm"], ref["ids"][i], x, y, f"prompt {i}")


def test_workload_exercises_prefix_cache_preemption_and_forks(ref, pp):
    for r in (ref, pp):
        assert r["stats"].preemptions > 0
        assert r["again"].prefix_hit_rate > 0
        assert len(r["tokens"][3]) == 2


def test_pp_greedy_tokens_and_logits_match_pp1(ref, pp):
    assert_same_or_near_tie(ref, pp)
    for a, b in zip(ref["logits"], pp["logits"], strict=True):
        torch.testing.assert_close(b, a, atol=LOGIT_ATOL, rtol=0)


def test_each_stage_holds_its_layers_and_their_kv(ref, pp):
    stages = len(pp["memory"])
    layers = [len(r) for r in l5.partition(5, stages)]  # 3+2 or 2+2+1
    per_layer_kv = ref["llm"].cache.nbytes // 5
    assert [m["kv"] for m in pp["memory"]] == [n * per_layer_kv for n in layers]
    full = sum(p.numel() * 4 for p in ref["llm"].model.net.parameters())
    assert sum(m["weights"] for m in pp["memory"]) == full  # every weight on exactly one stage
    assert all(row["busy_s"] > 0 for row in pp["busy"])  # every stage computed


def test_speculative_decoding_through_the_stages(model):
    """n-gram speculation: the verify step needs the logits of every drafted token (not only
    the last), which come back from the last stage per micro-batch; greedy output unchanged."""
    base = torch.randint(0, 211, (6,), generator=torch.Generator().manual_seed(5)).tolist()
    ps = [base * 3 + [i] for i in range(6)]  # repetitive: prompt lookup proposes drafts
    params = l5.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = l5.LLM(model, **ENGINE)
    want = [[o.outputs[0].token_ids] for o in ref.generate(ps, params)]
    with l5.LLM(model, pipeline_parallel_size=2, speculative=dict(method="ngram", k=3),
                **ENGINE) as llm:
        got = [[o.outputs[0].token_ids] for o in llm.generate(ps, params)]
        assert llm.stats.spec_proposed > 0
    assert_same_or_near_tie({"llm": ref, "ids": ps, "tokens": want}, {"tokens": got})


def test_stages_chained_in_one_process_equal_the_model():
    """No processes: StageNets over their own StageKVCaches, run in order, give the model's
    logits, for a prefill and then a decode step over the same paged blocks."""
    net = l3.random_model(random_config(), seed=3, std=0.3)
    full_cache = l5.engine.PagedKVCache.for_model(net.config, 8, 4, dtype=torch.float32)
    stages = [pp_stage.StageNet(net, s, 3) for s in range(3)]
    caches = [pp_stage.StageKVCache.for_stage(s, 8, 4) for s in stages]
    tables = [[0, 1, 2], [3, 4]]
    for qlens, clens, ids in (([7, 5], [0, 0], torch.arange(12) % 211),
                              ([1, 1], [7, 5], torch.tensor([5, 9]))):
        ctx = full_cache.context(qlens, clens, tables)
        want = net(ids, ctx, full_cache)
        x = ids
        for stage, cache in zip(stages, caches, strict=True):
            x = stage(x, ctx, cache)
        torch.testing.assert_close(x, want, atol=1e-5, rtol=0)


def test_the_last_stage_hands_off_logits_in_the_weights_dtype():
    """bf16 weights: the last stage's logits leave in bf16 (half the bytes of the largest
    message of a step) and, widened on rank 0, are exactly the model's."""
    net = l3.random_model(random_config(), seed=5, std=0.3, dtype=torch.bfloat16)
    full_cache = l5.engine.PagedKVCache.for_model(net.config, 8, 4, dtype=torch.bfloat16)
    stages = [pp_stage.StageNet(net, s, 2) for s in range(2)]
    caches = [pp_stage.StageKVCache.for_stage(s, 8, 4) for s in stages]
    ctx = full_cache.context([6, 3], [0, 0], [[0, 1], [2]])
    ids = torch.arange(9) % 211
    want = net(ids, ctx, full_cache)
    x = ids
    for stage, cache in zip(stages, caches, strict=True):
        x = stage(x, ctx, cache)
    assert x.dtype == torch.bfloat16
    torch.testing.assert_close(x.float(), want.float(), atol=0, rtol=0)


def test_micro_batches_cut_the_tokens_evenly():
    mb = pp_stage.micro_batches
    assert mb((1, 1, 1, 1), 2) == [(0, 2), (2, 4)]
    assert mb((10, 1, 1, 1), 2) == [(0, 10), (10, 13)]  # whole sequences
    assert mb((10, 1, 1, 1), 2, split=True) == [(0, 6), (6, 13)]  # the prefill cut too
    assert mb((1, 1), 4) == [(0, 1), (1, 2)]  # never an empty micro-batch
    assert mb((5, 5, 5, 1, 1, 1), 3) == [(0, 10), (10, 15), (15, 18)]
    assert pp_stage.pieces((10, 1, 1, 1), 6, 13) == [(0, 6, 10), (1, 0, 1), (2, 0, 1), (3, 0, 1)]
    for lens in ((3,), (1, 20, 1, 1, 1), (4, 4, 4, 4, 4, 4, 4)):
        for m in range(1, 9):
            for split in (False, True):
                cut = mb(lens, m, split=split)
                assert cut[0][0] == 0 and cut[-1][1] == sum(lens)
                assert all(a < b for a, b in cut)
                assert all(c[1] == d[0] for c, d in zip(cut, cut[1:], strict=False))
                assert len(cut) == min(m, sum(lens) if split else len(lens))


def test_a_prefill_cut_across_micro_batches_equals_the_model():
    """No processes: a 13-token prompt and a 4-token one, cut into 3 micro-batches (the long
    one across all three), run micro-batch by micro-batch through 3 StageNets over their own
    caches: the last-token logits equal the model's, and so does the next decode step."""
    net = l3.random_model(random_config(), seed=4, std=0.3)
    full_cache = l5.engine.PagedKVCache.for_model(net.config, 8, 4, dtype=torch.float32)
    stages = [pp_stage.StageNet(net, s, 3) for s in range(3)]
    caches = [pp_stage.StageKVCache.for_stage(s, 8, 4) for s in stages]
    tables = [[0, 1, 2, 3], [4, 5]]
    for qlens, clens, ids in (([13, 4], [0, 0], (torch.arange(17) * 7) % 211),
                              ([1, 1], [13, 4], torch.tensor([5, 9]))):
        ctx = full_cache.context(qlens, clens, tables)
        want = net(ids, ctx, full_cache, last_only=True)
        cuts = pp_stage.micro_batches(qlens, 3, split=True)
        parts = pp_stage.micro_contexts(ctx.query_lens_host, ctx.seq_lens_host, ctx.slot_mapping,
                                        ctx.block_tables, cuts, torch.device("cpu"))
        rows = []
        for t0, t1, mctx, final in parts:
            x = ids[t0:t1]
            for stage, cache in zip(stages, caches, strict=True):
                x = stage(x, mctx, cache, last_only=True)
            rows.append(x[final])
        # the later pieces read the earlier ones' keys from the cache: fp32 sum-order noise only
        torch.testing.assert_close(torch.cat(rows), want, atol=LOGIT_ATOL, rtol=0)


def test_bad_pipeline_sizes_are_named():
    model = l3.Model(l3.random_model(random_config(), seed=1))
    with pytest.raises(ValueError, match=r"valid sizes: 1 to 5"):
        l5.LLM(model, pipeline_parallel_size=6, num_blocks=8)
    with pytest.raises(ValueError, match="positive int"):
        l5.LLM(model, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="use tp_backend='torch'"):
        l5.LLM(model, pipeline_parallel_size=2, tensor_parallel_size=2, tp_backend="ours")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 cannot split"):
        l5.LLM(model, pipeline_parallel_size=2, tensor_parallel_size=3, num_blocks=8)
    with pytest.raises(ValueError, match="pp_micro_batches"):
        l5.EngineConfig(pipeline_parallel_size=2, pp_micro_batches=0)
    for sizes in (dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)):
        with pytest.raises(ValueError, match="prefill_cuda_graph runs on one rank only"):
            l5.EngineConfig(prefill_cuda_graph=True, **sizes)
        # "where it works" (None) turns itself off there, also when a size comes in later
        assert l5.EngineConfig(prefill_cuda_graph=None, **sizes).prefill_cuda_graph is False
        assert replace(l5.EngineConfig(prefill_cuda_graph=None), **sizes).prefill_cuda_graph \
            is False
    assert l5.EngineConfig(prefill_cuda_graph=None).prefill_cuda_graph is None
    assert l5.EngineConfig(prefill_cuda_graph=True).prefill_cuda_graph
    assert pp_stage.valid_pp_sizes(random_config()) == [1, 2, 3, 4, 5]


def test_run_with_more_stages_than_layers_is_one_line_and_exit_2(capsys):
    run_command = l3.comm.kernels.hardware.run_command
    assert run_command(commands.run, ["--pp", "7", "--device", "cpu"]) == 2  # course: 6 layers
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "valid sizes: 1 to 6" in err[0], err
    assert run_command(commands.run, ["--pp", "0", "--device", "cpu"]) == 2


def test_stage_graphs_on_the_cpu_run_every_decode_micro_batch(model, ref):
    """cuda_graph=True under PP: each stage's decode micro-batches go through its graph
    runner's static buffers (captured on GPUs; on a CPU run as they are), padding rows in the
    scratch block included (3 + 2 + ... rows into buckets of 4, 8): the same tokens."""
    with l5.LLM(model, pipeline_parallel_size=2, pp_micro_batches=2, cuda_graph=True,
                **ENGINE) as llm:
        out = run(llm)
        graphs = llm.runner.net.graphs
        assert graphs is not None and not graphs.captured and graphs.replays > 0
        assert graphs.buckets[-1] == ENGINE["max_num_seqs"]
    assert_same_or_near_tie(ref, out)
    with pytest.raises(ValueError, match="with tensor_parallel_size > 1 as well it is not"):
        l5.EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=2, cuda_graph=True)
