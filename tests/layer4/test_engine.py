"""The engine against layer 3's contiguous executor: greedy outputs equal for mixed batches,
tiny blocks, chunked prefill, prefix-cache hits, preemption under a tiny pool, static
batching; parallel sampling with copy-on-write; text and stop strings; metrics; aborts;
bad input."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import layer3_model as l3
from layer4_algorithms import LLM, SamplingParams

from .l4_helpers import TINY, assert_no_leak, greedy, random_prompts

LENGTHS = (5, 17, 3, 30, 9, 1)
MAX_TOKENS = (8, 3, 12, 5, 10, 6)


@pytest.fixture(scope="module")
def reference(tiny_model):
    prompts = random_prompts(LENGTHS)
    params = [greedy(m) for m in MAX_TOKENS]
    return prompts, params, [o.token_ids for o in tiny_model.generate_outputs(prompts, params)]


@pytest.mark.parametrize("block_size,budget,blocks",
                         [(16, 2048, 64), (4, 7, 64), (3, 5, 64), (1, 16, 200)])
def test_greedy_outputs_equal_layer3(tiny_model, reference, block_size, budget, blocks):
    prompts, params, want = reference
    llm = LLM(tiny_model, block_size=block_size, num_blocks=blocks, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert_no_leak(llm)


def test_a_long_prompt_is_prefilled_in_chunks_beside_decodes(tiny_model, reference):
    prompts, params, want = reference
    llm = LLM(tiny_model, block_size=4, num_blocks=64, max_num_batched_tokens=6)
    mixed = []
    original = llm.runner.execute

    def spy(out, *a):
        prefill = any(s.num_new_tokens > 1 for s in out.scheduled)
        if prefill and any(s.context_len > 0 and s.num_new_tokens == 1 for s in out.scheduled):
            mixed.append(len(llm.runner.plan_passes(out.scheduled)))
        return original(out, *a)

    llm.runner.execute = spy
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert mixed and set(mixed) == {1}  # prefill chunks and decodes in one forward pass


def test_forced_pass_splitting_gives_the_same_outputs(tiny_model, reference):
    prompts, params, want = reference
    llm = LLM(tiny_model, block_size=4, num_blocks=64, max_num_batched_tokens=12,
              attn_bytes_limit=1)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


def test_prefix_cache_hits_give_the_same_outputs_and_right_stats(tiny_model):
    shared = random_prompts([12], seed=5)[0]
    tails = random_prompts([3, 6, 1, 9], seed=6)
    prompts = [shared + t for t in tails]
    params = greedy(7)
    want = [o.token_ids for o in tiny_model.generate_outputs(prompts, params)]
    llm = LLM(tiny_model, block_size=4, num_blocks=64)
    llm.generate([shared + [3]], params)  # warms the cache with the shared 12 tokens (3 blocks)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.metrics.num_cached_tokens for o in outs] == [12] * 4
    st = llm.stats
    assert st.prefix_hit_tokens == 48 and st.prefix_queried_tokens == sum(len(p) for p in prompts)
    assert st.prefix_hit_rate == pytest.approx(48 / sum(len(p) for p in prompts))
    cold = LLM(tiny_model, block_size=4, num_blocks=64, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in cold.generate(prompts, params)] == want
    assert cold.stats.prefix_hit_tokens == 0
    assert_no_leak(llm)


def test_preemption_under_a_tiny_pool_completes_with_the_same_outputs(tiny_model, reference):
    prompts, params, want = reference
    # the longest needs 9
    llm = LLM(tiny_model, block_size=4, num_blocks=11, max_num_batched_tokens=64)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats.preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.stats.preemptions
    assert_no_leak(llm)


def test_static_batching_gives_the_same_outputs_in_more_steps(tiny_model, reference):
    prompts, params, want = reference
    cont = LLM(tiny_model, block_size=4, num_blocks=64, max_num_seqs=3)
    static = LLM(tiny_model, block_size=4, num_blocks=64, max_num_seqs=3, scheduling="static")
    assert [o.outputs[0].token_ids for o in cont.generate(prompts, params)] == want
    assert [o.outputs[0].token_ids for o in static.generate(prompts, params)] == want
    assert static.stats.steps > cont.stats.steps


def test_parallel_sampling_shares_prompt_blocks_copies_on_write_and_is_seeded(tiny_model):
    prompt = random_prompts([10], seed=3)[0]  # 2 full blocks of 4 + a partial one
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, n=3)
    llm = LLM(tiny_model, block_size=4, num_blocks=32)
    copies = []
    original = llm.runner.execute
    llm.runner.execute = lambda out, *a: (copies.extend(out.copies), original(out, *a))[1]
    llm.add_request(prompt, params, request_id="r")
    llm.step()  # prefill, then fork into 3
    seqs = llm._requests["r"][1]
    assert len(seqs) == 3 and len({tuple(s.block_table) for s in seqs}) == 1
    assert [llm.block_manager.ref_counts[b] for b in seqs[0].block_table] == [3, 3, 3]
    while llm.has_unfinished():
        llm.step()
    # the partial block: copied by the first two writers, the last writes in place
    assert len(copies) == 2
    out = llm.generate([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # completion i is what layer 3 samples with seed 11 + i: the shared, copied KV was right
    for c in out.outputs:
        ref = tiny_model.generate_outputs([prompt],
                                          l3.SamplingParams(temperature=1.0, seed=11 + c.index,
                                                                      max_tokens=6,
                                                                      ignore_eos=True))[0]
        assert c.token_ids == ref.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.generate([prompt], params)[0].outputs == out.outputs  # reproducible
    assert_no_leak(llm)


def test_text_stop_strings_and_eos_match_layer3(course_model):
    prompts = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\n\nROMEO.\n",
               "HAMLET.\nTo be"]
    params = [l3.SamplingParams(temperature=0, max_tokens=40, stop=("\n\n",)),
              l3.SamplingParams(temperature=0, max_tokens=25),
              l3.SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=30, stop=("the",))]
    want = course_model.generate_outputs(prompts, params)
    llm = LLM(course_model, block_size=8, num_blocks=128, max_num_batched_tokens=16)
    outs = llm.generate(prompts, params)
    for o, w in zip(outs, want, strict=True):
        c = o.outputs[0]
        assert (c.token_ids, c.text, c.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].prompt == prompts[0]


def test_metrics_and_stats_are_consistent(tiny_model, reference):
    prompts, params, _ = reference
    llm = LLM(tiny_model, block_size=4, num_blocks=64, max_num_seqs=2)
    outs = llm.generate(prompts, params, progress=True)
    for o in outs:
        m = o.metrics
        assert 0 <= m.queue_time <= m.ttft <= m.latency
        assert (m.tpot is None) == (len(o.outputs[0].token_ids) < 2)
        assert m.tpot is None or m.tpot > 0
    # max_num_seqs=2 queues
    assert max(o.metrics.queue_time for o in outs) > min(o.metrics.queue_time for o in outs)
    st = llm.stats
    assert st.requests == len(prompts) and st.generated_tokens == sum(MAX_TOKENS)
    assert st.prompt_tokens == sum(LENGTHS) and st.generated_tokens_per_s > 0
    assert st.acceptance_rate is None and st.as_dict()["requests"] == len(prompts)


def test_random_arrivals_and_aborts_on_the_real_model(tiny_model):
    rng = random.Random(0)
    llm = LLM(tiny_model, block_size=3, num_blocks=24, max_num_batched_tokens=10, max_num_seqs=4)
    shared = random_prompts([7], seed=9)[0]
    own = random_prompts([rng.randint(1, 20) for _ in range(10)])
    prompts = [shared + p if rng.random() < 0.5 else p for p in own]
    params = [greedy(rng.randint(1, 12)) for _ in prompts]
    want = [o.token_ids for o in tiny_model.generate_outputs(prompts, params)]
    done, pending, aborted = {}, list(enumerate(prompts)), set()
    while pending or llm.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                i, p = pending.pop(0)
                llm.add_request(p, params[i], request_id=str(i))
        if rng.random() < 0.1 and llm._requests:
            rid = rng.choice(sorted(llm._requests))
            assert llm.abort(rid).outputs[0].finish_reason in ("abort", "length")
            aborted.add(rid)
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert aborted and set(done) | aborted == {str(i) for i in range(len(prompts))}
    for rid, toks in done.items():
        assert toks == want[int(rid)]
    assert_no_leak(llm)


def test_bad_input_gets_clear_errors(tiny_model):
    llm = LLM(tiny_model, block_size=4, num_blocks=8, max_model_len=40)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request([5] * 38, greedy(5))
    with pytest.raises(ValueError, match="empty prompt"):
        llm.add_request([], greedy(5))
    for bad in ([500], [5, -1], [2**63], [2**64]):  # past the vocabulary, negative, huge
        with pytest.raises(ValueError, match="token ids"):
            llm.add_request(bad, greedy(5))
    with pytest.raises(ValueError, match="KV blocks"):
        llm.add_request([5] * 30, greedy(5))  # 35 tokens > 8 blocks of 4
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="too small"):
        LLM(tiny_model, kv_cache_bytes=100)
    with pytest.raises(ValueError, match="not both"):
        LLM(tiny_model, kv_cache_bytes=10**6, num_blocks=4)
    with pytest.raises(ValueError, match="policy"):
        LLM(tiny_model, num_blocks=4, scheduling="lottery")
    llm.add_request([5, 6], greedy(2), request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([5, 6], greedy(2), request_id="a")
    llm.abort("a")
    # all or nothing: the first is not left queued
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5, 6], [5] * 39], greedy(2))
    assert not llm.has_unfinished()
    with pytest.raises(ValueError, match="no prompts"):
        llm.generate([], greedy(2))


def test_cpu_default_budget_and_checkpoint_loading(tmp_path, tiny_model):
    l3.save_weights(tiny_model.net, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**TINY,
                                                      "architectures": ["LlamaForCausalLM"]}))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    assert llm.block_manager.num_blocks > 1000 and llm.cache.k.dtype == torch.float32
    out = llm.generate([[3, 4, 5]], greedy(4))[0]
    assert out.outputs[0].token_ids == tiny_model.generate_outputs([[3, 4, 5]],
                                                                   greedy(4))[0].token_ids


def test_generate_keeps_the_heap_frozen_only_while_it_runs(tiny_model):
    """generate() freezes the garbage collector's heap for its loop and unfreezes it after;
    a heap someone else froze (layer 6's worker) stays frozen."""
    import gc  # noqa: PLC0415

    llm = LLM(tiny_model, num_blocks=32)
    seen = []
    step = llm.step
    llm.step = lambda **kw: seen.append(gc.get_freeze_count()) or step(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert gc.get_freeze_count() == 0
    llm.generate([[1, 2, 3]], params)
    assert gc.get_freeze_count() == 0 and min(seen) > 0
    gc.freeze()
    try:
        llm.generate([[1, 2, 3]], params)
        assert gc.get_freeze_count() > 0  # not unfrozen (objects freed since have left it)
    finally:
        gc.unfreeze()


def test_id_prompts_are_packed_once_and_greedy_requests_draw_no_generator(tiny_model):
    llm = LLM(tiny_model, block_size=4, num_blocks=16, max_model_len=40)
    ids = [5, 0, 7, True, 9]  # (bools are ints)
    llm.add_request(ids, greedy(2))
    llm.add_request(tuple(ids), SamplingParams(temperature=0.8, max_tokens=2, seed=1))
    first, second = llm.scheduler.waiting
    assert first.prompt_array.dtype == np.int64 and first.prompt_array.tolist() == ids
    assert first.generator is None  # greedy: nothing to draw
    assert isinstance(second.generator, torch.Generator)
    out = llm.generate([ids], greedy(2))[0]
    assert out.prompt_token_ids == [5, 0, 7, 1, 9] and len(out.outputs[0].token_ids) == 2


def test_outputs_prompt_ids_are_the_prompts_and_a_running_requests_are_copies(tiny_model):
    llm = LLM(tiny_model, num_blocks=64, block_size=4)
    prompt = [5, 9, 2, 7, 7, 1]
    rid = llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outs = []
    while llm.has_unfinished():
        outs += llm.step(unfinished=True)
    outs += llm.drain()
    assert outs[-1].finished and all(o.prompt_token_ids == prompt for o in outs)
    outs[0].prompt_token_ids.append(99)  # a running request's output: the caller's own copy
    assert outs[-1].prompt_token_ids == prompt and llm.abort(rid) is None
    done = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
    assert done[0].prompt_token_ids == prompt and prompt == [5, 9, 2, 7, 7, 1]
