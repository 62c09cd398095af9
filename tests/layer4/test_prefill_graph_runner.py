"""PrefillGraphRunner: the engine's prefill steps through static buffers per token bucket give
the eager engine's logits and tokens, padding writes only the scratch block, steps that fit
no graph run eagerly.

On the CPU with capture=False (the runner's buffers, bucket padding, the "one" / "many"
layouts, eagerly, through layer 1's reference kernels), and on a GPU with real graphs
(gpu-marked): the engine with prefill graphs against the engine without."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import layer3_model as l3
from layer4_algorithms import LLM, EngineConfig, SamplingParams
from layer4_algorithms.prefill_graph_runner import PrefillGraphRunner, token_buckets

# head_dim 16 and no window: the triton backend's flash path (what the graphs need)
CONFIG = l3.ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=1024)
BLOCK_SIZE, NUM_BLOCKS = 4, 160


def model(backend: str = "triton", device: str = "cpu", dtype=torch.float32) -> l3.Model:
    return l3.Model(l3.random_model(CONFIG, seed=1, std=0.3, backend=backend, device=device,
                                    dtype=dtype))


def prompts(lengths, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def test_token_buckets():
    assert token_buckets(2048) == [128, 256, 512, 1024, 2048]
    assert token_buckets(300) == [128, 256, 300]
    assert token_buckets(100) == [100]
    assert token_buckets(128) == [128]
    assert token_buckets(5, smallest=2) == [2, 4, 5]
    for bad in (0, -3, 2.5, "8"):
        with pytest.raises(ValueError, match="max_tokens"):
            token_buckets(bad)


def with_runner(llm: LLM, max_tokens: int, max_seqs: int = 4) -> tuple[PrefillGraphRunner, list]:
    """llm's runner given an uncaptured PrefillGraphRunner; returns it and the plans it ran."""
    runner = PrefillGraphRunner(llm.runner.net, llm.cache, max_tokens,
                                llm.runner.tables.table.shape[1], max_seqs=max_seqs,
                                capture=False)
    plans = []
    inner = runner.run
    runner.run = lambda plan, *a, **k: plans.append(plan) or inner(plan, *a, **k)
    llm.runner.prefill_graph = runner
    return runner, plans


@pytest.mark.parametrize("budget,lengths,chunked", [
    (64, (37,), True),                  # one prompt, padded 37 -> 64: "one"
    (64, (5, 17, 30), True),            # several prompts in one step: "many"
    (48, (100, 7), True),               # chunks after cached context: "many", no "one"
    (200, (13, 29, 3, 41, 8, 60), True),  # more sequences than a graph holds: eager too
])
def test_engine_tokens_equal_the_eager_engines(budget, lengths, chunked):
    ps = prompts(lengths)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
              max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
              async_scheduling=False)
    net = model()
    ref = [o.outputs[0].token_ids for o in LLM(net, **kw).generate(ps, params)]
    llm = LLM(net, **kw)
    _, plans = with_runner(llm, budget)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert got == ref
    if len(lengths) > 4:  # one step of six prompts, then decode steps: nothing fits
        assert plans == []
        return
    assert plans, "no step went through the prefill graphs"
    assert all(b in token_buckets(budget) for b, _ in plans)
    if len(lengths) == 1:
        assert plans[0] == (64, "one")
    if budget == 48:  # the 100-token prompt's first chunk alone, its later ones with context
        assert {k for _, k in plans} == {"one", "many"}


def eager_step(llm, group, ids):
    r = llm.runner
    seqs = [s.seq for s in group]
    ctx = llm.cache.context([s.num_new_tokens for s in group], [s.context_len for s in group],
                            [q.block_table for q in seqs])
    with torch.no_grad():
        return r.net(ids, ctx, llm.cache, last_only=True)


@pytest.mark.parametrize("lengths,contexts", [((37,), (0,)), ((1,), (0,)), ((64,), (0,)),
                                              ((9, 20), (0, 11)), ((1, 5, 2), (7, 0, 3))])
def test_runner_logits_and_kv_equal_eager_and_padding_stays_in_scratch(lengths, contexts):
    """One step straight through the runner (awkward lengths, context before some chunks):
    its logits equal the eager forward's, every real slot holds what the eager step wrote,
    and every other slot of the pool is untouched except the scratch block."""
    from layer4_algorithms.scheduler_output import ScheduledSeq  # noqa: PLC0415
    from layer4_algorithms.sequence import Sequence  # noqa: PLC0415

    net = model()
    llm = LLM(net, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
              max_num_batched_tokens=64, async_scheduling=False)
    runner, _ = with_runner(llm, 64)
    cache = llm.cache
    g = torch.Generator().manual_seed(7)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    group, free = [], iter(range(NUM_BLOCKS - 1, -1, -1))  # blocks from the top: not 0
    for q, c in zip(lengths, contexts, strict=True):
        seq = Sequence(len(group), str(len(group)), prompts([q + c], seed=q + c)[0],
                       SamplingParams(max_tokens=1))
        seq.block_table = [next(free) for _ in range(-(-(q + c) // BLOCK_SIZE))]
        group.append(ScheduledSeq(seq, q, c))
    ids = torch.tensor(sum((s.input_ids for s in group), []), dtype=torch.int64)
    k0, v0 = cache.k.clone(), cache.v.clone()
    want = eager_step(llm, group, ids)
    k_eager, v_eager = cache.k.clone(), cache.v.clone()
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    plan = runner.plan(group)
    assert plan == (runner.bucket_for(sum(lengths)),
                    "one" if len(group) == 1 and contexts[0] == 0 else "many")
    table = np.array([s.seq.block_table + [0] * (8 - len(s.seq.block_table)) for s in group])
    lens = np.array([len(s.seq.block_table) for s in group])
    got = runner.run(plan, group, ids, table, lens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    scratch = cache.scratch_block
    outside = torch.ones(cache.k.shape[1], dtype=torch.bool)
    outside[scratch] = False
    # real blocks: what the eager step wrote, bit for bit where it did not differ from before
    torch.testing.assert_close(cache.k[:, outside], k_eager[:, outside], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, outside], v_eager[:, outside], rtol=1e-5, atol=1e-5)
    padded = plan[0] > sum(lengths)
    assert padded == (not torch.equal(cache.k[:, scratch], k0[:, scratch]))


def test_plan_falls_back_where_no_graph_fits():
    from layer4_algorithms.scheduler_output import ScheduledSeq  # noqa: PLC0415
    from layer4_algorithms.sequence import Sequence  # noqa: PLC0415

    llm = LLM(model(), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
              max_num_batched_tokens=300, async_scheduling=False)
    runner, _ = with_runner(llm, 300, max_seqs=2)
    assert runner.buckets == [128, 256, 300]

    def s(q, c=0, spec=()):
        out = ScheduledSeq(Sequence(0, "0", list(range(2, 2 + q + c)), SamplingParams()), q, c)
        out.spec_token_ids = list(spec) if spec else ()
        return out
    assert runner.plan([s(128)]) == (128, "one")
    assert runner.plan([s(129)]) == (256, "one")
    assert runner.plan([s(10, 5)]) == (128, "many")
    assert runner.plan([s(100), s(200)]) == (300, "many")
    assert runner.plan([s(301)]) is None  # past the largest bucket
    assert runner.plan([s(1), s(1), s(1)]) is None  # more sequences than max_seqs
    assert runner.plan([s(1, 9, spec=[3, 4])]) is None  # drafts to verify
    assert runner.plan([]) is None
    one = s(20)
    one.seq.block_table = [5] * 3  # 12 slots for 20 tokens
    table = np.array([one.seq.block_table])
    with pytest.raises(ValueError, match="cannot hold 20 tokens"):
        runner.run((128, "one"), [one], torch.zeros(20, dtype=torch.int64), table, np.array([3]))
    wide = np.zeros((1, runner.width + 1), dtype=np.int64)
    assert runner.run((128, "one"), [s(20)], torch.zeros(20, dtype=torch.int64), wide,
                      np.array([runner.width + 1])) is None
    with pytest.raises(ValueError, match="input ids must be"):
        runner.run((128, "one"), [s(20)], torch.zeros(19, dtype=torch.int64),
                   np.zeros((1, 5), dtype=np.int64), np.array([5]))


def test_errors():
    llm = LLM(model(), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
              async_scheduling=False)
    torch_llm = LLM(model("torch"), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="triton backend"):
        PrefillGraphRunner(torch_llm.runner.net, torch_llm.cache, 64, 8, capture=False)
    with pytest.raises(TypeError, match="paged cache"):
        PrefillGraphRunner(llm.runner.net, object(), 64, 8, capture=False)
    with pytest.raises(ValueError, match="max_seqs"):
        PrefillGraphRunner(llm.runner.net, llm.cache, 64, 8, max_seqs=0, capture=False)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA GPU"):
            PrefillGraphRunner(llm.runner.net, llm.cache, 64, 8)
    with pytest.raises(ValueError, match="prefill_cuda_graph must be True, False or None"):
        EngineConfig(prefill_cuda_graph="yes")
    # on a CPU the switch captures nothing: eager; None ("where it works") resolves to off
    cpu = LLM(model(), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, prefill_cuda_graph=True)
    assert cpu.runner.prefill_graph is None
    auto = LLM(model(), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, prefill_cuda_graph=None)
    assert auto.runner.prefill_graph is None and auto.config.prefill_cuda_graph is False


def test_host_ids_ride_with_the_inputs_and_a_lone_prompt_sets_its_length():
    """Input ids given on the host (numpy) land in the graph's ids with the other inputs and
    give the device ids' logits; a lone prompt's step ("one") writes the bucket as seq_lens[0]
    even after a "many" step wrote a sequence's length there."""
    from layer4_algorithms.scheduler_output import ScheduledSeq  # noqa: PLC0415
    from layer4_algorithms.sequence import Sequence  # noqa: PLC0415

    llm = LLM(model(), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
              max_num_batched_tokens=64, async_scheduling=False)
    runner, _ = with_runner(llm, 64)
    ids = prompts([37], seed=5)[0]
    seq = Sequence(0, "0", ids, SamplingParams(max_tokens=1))
    seq.block_table = list(range(100, 100 + -(-37 // BLOCK_SIZE)))
    group = [ScheduledSeq(seq, 37, 0)]
    table, lens = np.array([seq.block_table]), np.array([len(seq.block_table)])
    runner.seq_lens[0] = 5  # what a "many" step leaves there
    on_device = runner.run((64, "one"), group, torch.tensor(ids), table, lens).clone()
    assert int(runner.seq_lens[0]) == 64
    runner.seq_lens[0] = 5
    runner.ids.zero_()
    on_host = runner.run((64, "one"), group, np.array(ids, dtype=np.int64), table, lens)
    assert int(runner.seq_lens[0]) == 64
    assert runner.ids[:37].tolist() == ids
    torch.testing.assert_close(on_host, on_device)


@pytest.mark.gpu
@pytest.mark.parametrize("budget,lengths,kinds", [
    (512, (1, 37, 129, 300, 511, 512), {"one"}),  # one prompt at a time
    (256, (5, 17, 30), {"many"}),                 # three prompts in one step
    (96, (250, 7, 61), {"one", "many"})])          # chunks: the first alone, then with context
def test_gpu_engine_with_prefill_graphs_equals_without(budget, lengths, kinds):
    """The engine on a GPU with prefill graphs (captured) against the same engine without:
    greedy tokens equal, the first token's logits close (bf16; padded GEMMs may pick other
    cuBLAS kernels), awkward prompt lengths one at a time, several in a step, chunked."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    net = model(device="cuda", dtype=torch.bfloat16)
    kw = dict(num_blocks=NUM_BLOCKS * 4, block_size=16, max_num_seqs=8,
              max_num_batched_tokens=budget, cuda_graph=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    ps = prompts(lengths, seed=11)
    plain, graphed = LLM(net, **kw), LLM(net, prefill_cuda_graph=True, **kw)
    assert graphed.runner.prefill_graph is not None
    assert graphed.runner.prefill_graph.buckets == token_buckets(budget)
    assert graphed.runner.prefill_graph.pool_bytes > 0  # the graphs' own pool, measured
    print(f"prefill graph pool: {graphed.runner.prefill_graph.pool_bytes / 2**20:.1f} MiB "
          f"for buckets {graphed.runner.prefill_graph.buckets}", flush=True)
    runs = []
    inner = graphed.runner.prefill_graph.run
    graphed.runner.prefill_graph.run = lambda plan, *a, **k: runs.append(plan) or inner(
        plan, *a, **k)
    if len(lengths) > 3:  # one prompt a step: the "one" graphs
        want = [plain.generate([p], params)[0] for p in ps]
        got = [graphed.generate([p], params)[0] for p in ps]
    else:
        want, got = plain.generate(ps, params), graphed.generate(ps, params)
    assert {k for _, k in runs} == kinds
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lw, lg = w.outputs[0].logprobs[0], g.outputs[0].logprobs[0]  # the prefill's token
        assert abs(lw.logprob - lg.logprob) < 0.05
        want_top, got_top = dict(lw.top), dict(lg.top)
        for t in want_top.keys() & got_top.keys():
            assert abs(want_top[t] - got_top[t]) < 0.05
