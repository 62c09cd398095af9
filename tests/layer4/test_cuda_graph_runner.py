"""CudaGraphRunner: decode steps replayed from bucketed CUDA graphs give the eager model's
logits, and padding rows write only into the cache's scratch block.

The same checks run on the CPU with capture=False (the runner's buffers, bucket padding and
slot computation, eagerly) and on a GPU with real graphs (gpu-marked)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import layer3_model as l3
from layer4_algorithms import PagedKVCache
from layer4_algorithms.cuda_graph_runner import CudaGraphRunner, bucket_sizes

CONFIG = l3.ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16,
                        max_position_embeddings=64, layer_windows=(None, 5))
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, MAX_SEQS = 4, 48, 6, 12
PROMPT_LENS = [3, 9, 1, 6, 4, 8, 2, 7, 5, 4, 9, 1]
# buckets 12, 8, 4, 1, 8
STEPS = [list(range(12)), [0, 1, 2, 3, 4], [7, 2, 9], [4], [11, 10, 0, 5, 6, 8, 1]]


def test_buckets():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError, match="max_num_seqs"):
        bucket_sizes(0)


def prefilled(device: str, dtype: torch.dtype) -> tuple[l3.LlamaModel, PagedKVCache,
                                                        list[list[int]], list[int], list[int]]:
    """A random model, a paged cache holding 12 prompts in shuffled blocks (room for every
    step), their block tables, lengths and first decode tokens."""
    model = l3.random_model(CONFIG, dtype=dtype, device=device, seed=1, std=0.3)
    cache = PagedKVCache.for_model(CONFIG, NUM_BLOCKS, BLOCK_SIZE, dtype=dtype, device=device)
    steps_per_seq = [sum(b in step for step in STEPS) for b in range(len(PROMPT_LENS))]
    need = [-(-(n + s) // BLOCK_SIZE) for n, s in zip(PROMPT_LENS, steps_per_seq, strict=True)]
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(ids[used:used + n])
        used += n
    assert used <= NUM_BLOCKS and max(need) <= MAX_BLOCKS
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(2, CONFIG.vocab_size, (sum(PROMPT_LENS),), generator=g).to(device)
    with torch.no_grad():
        ctx = cache.context(PROMPT_LENS, [0] * len(PROMPT_LENS), tables)
        first = model(prompts, ctx, cache, last_only=True).argmax(-1).tolist()
    return model, cache, tables, list(PROMPT_LENS), first


def copy_cache(cache: PagedKVCache) -> PagedKVCache:
    twin = PagedKVCache.for_model(CONFIG, NUM_BLOCKS, BLOCK_SIZE, dtype=cache.k.dtype,
                                  device=cache.device)
    twin.k.copy_(cache.k)
    twin.v.copy_(cache.v)
    return twin


def check_replay_matches_eager(device: str, dtype: torch.dtype, capture: bool, tol: float,
                               inputs: str = "device") -> None:
    """inputs: how each step's context reaches the graph: "device" (run: tensors), "host"
    (run_host: numpy positions and tables, one copy), "mixed" (the two in turn: rows a
    smaller bucket left behind must not matter to the next one); "copies": run_host through
    host arrays and copies as on a GPU (on a CPU it writes the buffers in place); " ids":
    run_host's input ids from the host (numpy, in the context's copy) every other step;
    " gather": every other step's ids gathered on the device from a tensor holding them in
    reverse order, the index in the context's copy."""
    model, cache, tables, lens, tokens = prefilled(device, dtype)
    eager_cache = copy_cache(cache)
    runner = CudaGraphRunner(model, cache, MAX_SEQS, MAX_BLOCKS, capture=capture,
                             copies=True if inputs.startswith("copies") else None)
    assert sorted(runner.graphs) == (runner.buckets if capture else [])
    for i, step in enumerate(STEPS):
        ctx = eager_cache.context([1] * len(step), [lens[b] for b in step],
                                  [tables[b] for b in step])
        ids = torch.tensor([tokens[b] for b in step], device=device)
        with torch.no_grad():
            eager = model(ids, ctx, eager_cache, last_only=True)
        bucket = next(b for b in runner.buckets if b >= len(step))
        if bucket > len(step):
            cache.k[:, cache.scratch_block] = 0.0  # so we see the padding rows' writes land there
        if inputs.split()[0] in ("host", "copies") or (inputs == "mixed" and i % 2):
            pos, table = ctx.positions.cpu().numpy(), ctx.block_tables.cpu().numpy()
            if inputs.endswith(" ids") and i % 2 == 0:
                replay = runner.run_host(ids.cpu().numpy(), pos, table).clone()
            elif inputs.endswith(" gather") and i % 2 == 0:
                backwards = np.arange(len(step))[::-1].copy()
                replay = runner.run_host(ids.flip(0), pos, table, backwards).clone()
            else:
                replay = runner.run_host(ids, pos, table).clone()
        else:
            replay = runner.run(ids, ctx.positions, ctx.block_tables, ctx.seq_lens)
        assert replay.shape == (len(step), CONFIG.vocab_size) and replay.dtype == torch.float32
        torch.testing.assert_close(replay, eager, rtol=tol, atol=tol)
        # the step's greedy tokens, made inside the graph: its logits' argmax, exactly
        assert runner.tokens(len(step)).tolist() == replay.argmax(-1).tolist()
        # padding rows wrote their one token (position 0) into the scratch block
        if bucket > len(step):
            written = cache.k[:, cache.scratch_block].abs().sum(dim=(0, 2, 3)) > 0  # per slot
            assert written.tolist() == [True] + [False] * (BLOCK_SIZE - 1)
        for b, t in zip(step, replay.argmax(-1).tolist(), strict=True):
            lens[b] += 1
            tokens[b] = t
    # the real blocks: what eager decoding wrote, and nothing anywhere else
    real = torch.zeros(NUM_BLOCKS + 1, BLOCK_SIZE, dtype=torch.bool)
    for table, n in zip(tables, lens, strict=True):
        for p in range(n):
            real[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = True
    real = real.to(device)
    for ours, theirs in ((cache.k, eager_cache.k), (cache.v, eager_cache.v)):
        torch.testing.assert_close(ours[:, real], theirs[:, real], rtol=tol, atol=tol)
        untouched = ~real
        untouched[NUM_BLOCKS] = False  # the scratch block
        assert (ours[:, untouched] == 0).all()


@pytest.mark.parametrize("inputs", ["device", "host", "mixed", "copies", "host ids",
                                    "copies ids", "host gather", "copies gather"])
def test_eager_buffers_match_the_model_on_cpu(inputs):
    check_replay_matches_eager("cpu", torch.float32, capture=False, tol=1e-5, inputs=inputs)


def test_errors():
    model, cache, tables, lens, tokens = prefilled("cpu", torch.float32)
    with pytest.raises(RuntimeError, match="CUDA"):
        # CPU model on a GPU machine
        CudaGraphRunner(model, cache, MAX_SEQS, MAX_BLOCKS) if not torch.cuda.is_available() else \
            CudaGraphRunner(model, cache, MAX_SEQS, MAX_BLOCKS, capture=True)
    with pytest.raises(TypeError, match="paged cache"):
        CudaGraphRunner(model, l3.ContiguousKVCache.for_model(CONFIG, 2, 8, dtype=torch.float32),
                        MAX_SEQS, MAX_BLOCKS, capture=False)
    runner = CudaGraphRunner(model, cache, MAX_SEQS, MAX_BLOCKS, capture=False)
    assert runner.can_run(12, 6) and not runner.can_run(13, 1) and not runner.can_run(1, 7)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not fit"):
        runner.run(one, one, torch.zeros(1, MAX_BLOCKS + 1, dtype=torch.int64), one + 1)
    with pytest.raises(ValueError, match="expected input_ids"):
        runner.run(one, torch.zeros(2, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                   one + 1)
    with pytest.raises(ValueError, match="does not fit"):
        runner.run_host(one, np.zeros(1, np.int64), np.zeros((1, MAX_BLOCKS + 1), np.int64))
    with pytest.raises(ValueError, match="does not fit"):
        runner.run_host(one, np.zeros(2, np.int64), np.zeros((1, 1), np.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("inputs", ["device", "host", "mixed", "host ids", "host gather"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_gpu_replay_matches_eager_and_padding_stays_in_scratch(dtype, tol, inputs):
    check_replay_matches_eager("cuda", dtype, capture=True, tol=tol, inputs=inputs)


@pytest.mark.gpu
def test_gpu_graphs_share_one_pool_and_reuse_buffers():
    model, cache, tables, lens, tokens = prefilled("cuda", torch.bfloat16)
    runner = CudaGraphRunner(model, cache, MAX_SEQS, MAX_BLOCKS)
    pools = {g.pool() for g in runner.graphs.values()}
    assert len(pools) == 1
    ctx = cache.context([1, 1], [lens[0], lens[1]], [tables[0], tables[1]])
    ids = torch.tensor(tokens[:2], device="cuda")
    before = runner.input_ids.data_ptr(), runner.logits.data_ptr()
    a = runner.run(ids, ctx.positions, ctx.block_tables, ctx.seq_lens)
    assert (runner.input_ids.data_ptr(), runner.logits.data_ptr()) == before
    # same slots rewritten: same logits
    b = runner.run(ids, ctx.positions, ctx.block_tables, ctx.seq_lens)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_steady_decode_copies_no_ids_and_tables_only_when_they_change():
    """run_host through host arrays and copies (the GPU's path): a step whose input ids are
    the last step's own greedy tokens (a view of the graph's buffer) copies no ids, and a
    step whose block tables equal the last step's copies no table rows; the logits stay the
    eager model's."""
    model, cache, tables, lens, tokens = prefilled("cpu", torch.float32)
    eager_cache = copy_cache(cache)
    runner = CudaGraphRunner(model, cache, MAX_SEQS, MAX_BLOCKS, capture=False, copies=True)
    g = runner.inputs
    copies, changed = [], []
    inner_copy = torch.Tensor.copy_
    seqs = [0, 1, 2]
    ids = torch.tensor([tokens[b] for b in seqs])
    try:
        torch.Tensor.copy_ = lambda t, src, **k: copies.append(
            (t.data_ptr(), tuple(t.shape))) or inner_copy(t, src, **k)
        last = None
        for i in range(3):  # each table as long as its step needs: the first one grows once
            ctx = eager_cache.context([1] * 3, [lens[b] for b in seqs],
                                      [tables[b][:lens[b] // BLOCK_SIZE + 1] for b in seqs])
            with torch.no_grad():
                eager = model(ids if i == 0 else runner.tokens(3).clone(), ctx, eager_cache,
                              last_only=True)
            copies.clear()
            got = runner.run_host(ids if i == 0 else runner.tokens(3), ctx.positions.numpy(),
                                  ctx.block_tables.numpy())
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
            wrote = {p for p, _ in copies}
            assert (runner.input_ids.data_ptr() in wrote) == (i == 0)  # ids: first step only
            # tables: the first step, then only when a sequence's table grew
            table = ctx.block_tables.numpy().copy()
            same = last is not None and np.array_equal(table, last)
            assert (g.block_tables.data_ptr() in wrote) == (not same)
            last = table
            changed.append(not same)
            for b in seqs:
                lens[b] += 1
    finally:
        torch.Tensor.copy_ = inner_copy
    assert changed[0] and not all(changed) and any(changed[1:])  # both cases seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_decode_through_the_graph_runner_gives_the_plain_engines_tokens(async_scheduling):
    """The runner's decode passes through the graph runner (capture=False on a CPU: its static
    buffers, run eagerly), which takes positions and block tables from the host (run_host:
    one copy into its buffers) instead of a whole AttentionContext: the plain engine's greedy
    tokens."""
    from layer4_algorithms import LLM, SamplingParams  # noqa: PLC0415

    model = l3.Model(l3.random_model(CONFIG, seed=1, std=0.3))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, CONFIG.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENS[:6]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
              async_scheduling=async_scheduling)
    ref = [o.outputs[0].token_ids for o in LLM(model, **kw).generate(prompts, params)]
    llm = LLM(model, **kw)
    graph = CudaGraphRunner(model.net, llm.cache, 8, MAX_BLOCKS + 2, capture=False)
    runs = []
    inner = graph.run_host
    graph.run_host = lambda *a, **k: runs.append(a[0].shape[0]) or inner(*a, **k)
    llm.runner.graph = graph
    contexts = []
    context = llm.cache.context
    llm.cache.context = lambda *a, **k: contexts.append(len(a[0])) or context(*a, **k)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == ref
    assert len(runs) >= 11 and max(runs) == 6  # every decode step went through the graph runner
    assert contexts == [6]  # only the prefill built an AttentionContext


@pytest.mark.parametrize("copies", [False, True])
def test_engine_steps_in_a_new_order_gather_the_last_tokens_with_the_context(copies):
    """Async decoding through the graph runner while sequences finish at different steps: a
    step whose input tokens are all on the device but in another order than the last step's
    sends its gather index with the context (run_host's gather), a step of host tokens sends
    them the same way; the plain engine's greedy tokens either way (copies: as on a GPU)."""
    from layer4_algorithms import LLM, SamplingParams  # noqa: PLC0415

    model = l3.Model(l3.random_model(CONFIG, seed=1, std=0.3))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, CONFIG.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENS[:6]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (12, 5, 9, 3, 12, 7)]
    kw = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
              async_scheduling=True)
    ref = [o.outputs[0].token_ids for o in LLM(model, **kw).generate(prompts, params)]
    llm = LLM(model, **kw)
    graph = CudaGraphRunner(model.net, llm.cache, 8, MAX_BLOCKS + 2, capture=False,
                            copies=copies)
    kinds = []
    inner = graph.run_host

    def run_host(ids, pos, table, gather=None):
        kinds.append("gather" if gather is not None else
                     "host" if isinstance(ids, np.ndarray) else "device")
        return inner(ids, pos, table, gather)
    graph.run_host = run_host
    llm.runner.graph = graph
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    assert {"gather", "host", "device"} <= set(kinds)


def test_sampled_requests_beside_greedy_ones_through_the_graph_runner():
    """While a request samples at a temperature, every step goes through sample_tokens (its
    seeded draws: the plain engine's tokens); once only greedy requests are live, the graph's
    argmax is taken as the step's tokens without it; the live count of sampling requests is
    back to 0 after finishing and aborted requests."""
    from layer4_algorithms import (  # noqa: PLC0415
        LLM,
        SamplingParams,
        model_runner,  # noqa: PLC0415
    )

    model = l3.Model(l3.random_model(CONFIG, seed=1, std=0.3))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, CONFIG.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENS[:5]]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i,
                             max_tokens=12 if i % 2 else 3, ignore_eos=True) for i in range(5)]
    kw = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8, async_scheduling=True)
    ref = [o.outputs[0].token_ids for o in LLM(model, **kw).generate(prompts, params)]
    llm = LLM(model, **kw)
    llm.runner.graph = CudaGraphRunner(model.net, llm.cache, 8, MAX_BLOCKS + 2, capture=False)
    calls = []
    inner = model_runner.ModelRunner.sample_tokens
    llm.runner.sample_tokens = lambda *a, **k: calls.append(len(a[1])) or inner(llm.runner, *a, **k)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    # the sampling requests' steps called it; the greedy ones' last ~9 steps did not
    assert 0 < len(calls) <= llm.stats.steps - 8 and llm._random_live == 0
    rid = llm.add_request(prompts[0], params[0])
    assert llm._random_live == 1
    llm.abort(rid)
    assert llm._random_live == 0
