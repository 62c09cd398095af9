"""Async scheduling (EngineConfig.async_scheduling): step N+1 is scheduled and launched before
step N's tokens are read. On a CPU it gains nothing, but the same path runs (inputs gathered
from the previous step's token tensor, outputs one step late, finished sequences' extra
token discarded), so every test here compares it with the synchronous engine: identical
outputs, no leaked blocks, whatever the batch, chunking, pool, stops, aborts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from layer4_algorithms import LLM, EngineConfig, SamplingParams
from layer4_algorithms import model_runner as MR

from .l4_helpers import assert_no_leak, greedy, random_prompts


@pytest.fixture
def overlap_calls(monkeypatch):
    """Counts executes that took their inputs from the previous step's device tokens."""
    calls = []
    execute = MR.ModelRunner.execute

    def spy(self, out, prev_tokens=None):
        if prev_tokens is not None:
            calls.append(sum(s.pending >= 0 for s in out.scheduled))
        return execute(self, out, prev_tokens)
    monkeypatch.setattr(MR.ModelRunner, "execute", spy)
    return calls


def run_both(model, prompts, params, **kw):
    """(sync outputs, async outputs, the async engine) for the same requests."""
    outs = []
    for mode in (False, True):
        llm = LLM(model, async_scheduling=mode, **kw)
        assert llm.config.async_scheduling is mode
        outs.append(llm.generate(prompts, params))
        assert_no_leak(llm)
        assert llm._inflight is None  # generate drained the step left on the device
    return outs[0], outs[1], llm


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("lengths, budget, bs", [
    ([5], 64, 4), ([3, 17, 9], 7, 4), ([1, 2, 30, 11, 4, 8, 19], 13, 3),
    ([6] * 13, 16, 16)])
def test_greedy_outputs_match_the_synchronous_engine(tiny_model, overlap_calls, lengths, budget,
                                                     bs):
    prompts = random_prompts(lengths, seed=len(lengths))
    params = [greedy(m) for m in [7, 1, 12, 3, 9, 2, 15, 5, 8, 4, 6, 11, 10][:len(lengths)]]
    want, got, llm = run_both(tiny_model, prompts, params, block_size=bs, num_blocks=200,
                              max_num_batched_tokens=budget, max_num_seqs=5)
    assert tokens(got) == tokens(want)
    assert overlap_calls and max(overlap_calls) > 0  # the overlap path really ran
    ref = [o.token_ids for o in tiny_model.generate_outputs(prompts, params)]
    assert [t[0] for t in tokens(got)] == ref


def test_steady_decoding_reads_the_previous_tokens_in_place(tiny_model, monkeypatch):
    """Sequences decoding in last step's order take their input ids as a view of last step's
    token tensor (no index copy, no gather); once a sequence finishes and the rows shift, the
    gather comes back. The tokens are the synchronous engine's either way."""
    seen = []
    place = MR.ModelRunner.place_ids

    def spy(self, ids, src, dst, prev_tokens, in_order=False):
        got = place(self, ids, src, dst, prev_tokens, in_order)
        if prev_tokens is not None and len(dst) == len(ids):
            seen.append((in_order, got.data_ptr() == prev_tokens.data_ptr()))
            assert got.tolist() == prev_tokens[src].tolist()
        return got
    monkeypatch.setattr(MR.ModelRunner, "place_ids", spy)
    prompts = random_prompts([4, 9, 6], seed=3)
    params = [greedy(m) for m in (12, 5, 9)]  # the 5-token one finishes first: rows shift
    want, got, _ = run_both(tiny_model, prompts, params, block_size=4, num_blocks=64)
    assert tokens(got) == tokens(want)
    assert (True, True) in seen and (False, False) in seen  # in place, then gathered
    assert all(view == in_order for in_order, view in seen)


def test_preemption_under_a_tiny_pool(tiny_model, overlap_calls):
    prompts = random_prompts([9, 14, 5, 11, 7, 3], seed=3)
    params = [greedy(m) for m in (20, 15, 25, 9, 18, 12)]
    want, got, llm = run_both(tiny_model, prompts, params, block_size=4, num_blocks=16,
                              max_num_batched_tokens=12, max_num_seqs=6)
    assert tokens(got) == tokens(want)
    assert llm.stats.preemptions > 0 and overlap_calls


@pytest.mark.parametrize("policy", ["static", "priority"])
def test_other_policies_and_prefix_cache_hits(tiny_model, policy):
    shared = random_prompts([12], seed=5)[0]
    prompts = [shared + p for p in random_prompts([3, 1, 6, 2, 9], seed=6)]
    params = [greedy(m) for m in (6, 9, 3, 12, 5)]
    want, got, llm = run_both(tiny_model, prompts, params, block_size=4, num_blocks=64,
                              max_num_seqs=3, scheduling=policy)
    assert tokens(got) == tokens(want)
    assert llm.stats.prefix_hit_rate > 0


def test_stop_strings_eos_and_max_tokens_on_the_course_model(course_model, overlap_calls):
    prompts = ["ROMEO.\n", "JULIET.\nO Romeo", "First Citizen:\n", "KING", "A"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=["\n\n"]),
              SamplingParams(temperature=0.0, max_tokens=25, stop=["the", "e"]),
              SamplingParams(temperature=0.0, max_tokens=1),
              SamplingParams(temperature=0.0, max_tokens=60),
              SamplingParams(temperature=0.0, max_tokens=33, stop=[","])]
    want, got, _ = run_both(course_model, prompts, params, num_blocks=256, max_num_seqs=4,
                            max_num_batched_tokens=32)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert {o.outputs[0].finish_reason for o in got} >= {"stop", "length"}
    assert overlap_calls


def test_eos_is_not_emitted_and_the_extra_token_is_discarded(tiny_model):
    """eos_token_id 1 without ignore_eos: sequences end at different steps, each after
    the engine has already scheduled one more step for it."""
    prompts = random_prompts([4, 8, 2, 6, 10, 3, 7], seed=11) + random_prompts([3, 5, 7, 9], seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=40)] * len(prompts)
    want, got, _ = run_both(tiny_model, prompts, params, block_size=4, num_blocks=200,
                            max_num_seqs=4)
    assert tokens(got) == tokens(want)
    reasons = [o.outputs[0].finish_reason for o in got]
    assert reasons == [o.outputs[0].finish_reason for o in want] and reasons.count("eos") >= 2


def test_parallel_sampling_and_seeded_sampling_match(tiny_model):
    prompts = random_prompts([5, 9, 3], seed=2)
    params = [SamplingParams(temperature=0.9, max_tokens=8, n=3, seed=7, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, max_tokens=11, seed=1, ignore_eos=True),
              greedy(6)]
    want, got, _ = run_both(tiny_model, prompts, params, block_size=4, num_blocks=100,
                            max_num_seqs=6)
    assert tokens(got) == tokens(want)
    assert len(got[0].outputs) == 3


def test_penalties_and_logprobs_run_synchronously_with_the_same_outputs(tiny_model):
    prompts = random_prompts([6, 4, 9], seed=4)
    params = [greedy(10, frequency_penalty=0.8), greedy(7, logprobs=2), greedy(12)]
    want, got, _ = run_both(tiny_model, prompts, params, block_size=4, num_blocks=100)
    assert tokens(got) == tokens(want)
    assert [t.logprob for t in got[1].outputs[0].logprobs] == pytest.approx(
        [t.logprob for t in want[1].outputs[0].logprobs])


def test_step_by_step_with_aborts_and_late_arrivals(tiny_model):
    """The online loop (layer 6): requests arrive while others run, some are aborted. The
    survivors' outputs equal the synchronous engine's; an aborted one's tokens are a prefix
    of its full greedy output; nothing leaks."""
    prompts = random_prompts([7, 3, 12, 5, 9, 4], seed=9)
    full = [o.token_ids for o in tiny_model.generate_outputs(prompts, [greedy(14)] * 6)]
    for mode in (False, True):
        llm = LLM(tiny_model, block_size=4, num_blocks=60, max_num_seqs=3,
                  max_num_batched_tokens=10, async_scheduling=mode)
        done, step = {}, 0
        llm.add_request(prompts[0], greedy(14), request_id="0")
        llm.add_request(prompts[1], greedy(14), request_id="1")
        while llm.has_unfinished() or step < 4:
            if step == 2:
                for i in (2, 3, 4):
                    llm.add_request(prompts[i], greedy(14), request_id=str(i))
            if step == 5:
                out = llm.abort("3")
                assert out is not None and out.outputs[0].finish_reason == "abort"
                done["3"] = out
                llm.add_request(prompts[5], greedy(14), request_id="5")
            if step == 7:
                done["1"] = llm.abort("1") or done.get("1")
            for o in llm.step():
                if o.finished:
                    done[o.request_id] = o
            step += 1
            assert step < 200
        assert_no_leak(llm)
        for rid in ("0", "2", "4", "5"):
            assert done[rid].outputs[0].token_ids == full[int(rid)], (mode, rid)
        for rid in ("1", "3"):
            got = done[rid].outputs[0].token_ids
            assert got == full[int(rid)][:len(got)]


def test_streamed_outputs_grow_and_end_as_in_generate(tiny_model):
    prompts = random_prompts([5, 8], seed=13)
    llm = LLM(tiny_model, block_size=4, num_blocks=60, async_scheduling=True)
    for i, p in enumerate(prompts):
        llm.add_request(p, greedy(9 + i), request_id=str(i))
    seen = {"0": [], "1": []}
    while llm.has_unfinished():
        for o in llm.step():
            toks = o.outputs[0].token_ids
            assert toks[:len(seen[o.request_id])] == seen[o.request_id]  # never taken back
            seen[o.request_id] = toks
    want = [o.token_ids for o in tiny_model.generate_outputs(prompts, [greedy(9), greedy(10)])]
    assert [seen["0"], seen["1"]] == want


def finish_with_two_more(llm, prompts, outs, want) -> None:
    """Runs "0" (its first token in outs) to the end, two more prompts arriving at its second
    step (two prefills at once while "0" decodes: a mixed step overlaps); every request's
    tokens must be `want`'s, nothing leaked."""
    seen = {"0": outs[0].outputs[0].token_ids}
    step = 0
    while llm.has_unfinished():
        if step == 1:
            llm.add_request(prompts[1], greedy(6), request_id="1")
            llm.add_request(prompts[2], greedy(6), request_id="2")
        for o in llm.step():
            seen[o.request_id] = o.outputs[0].token_ids
        step += 1
        assert step < 100
    llm.drain()
    assert_no_leak(llm)
    assert [seen[r] for r in "012"] == want


def test_first_tokens_come_back_before_the_next_launch(tiny_model, overlap_calls):
    """A step that only samples first tokens is read before anything else is launched: a lone
    request's first token comes out of the call after its prefill, with one step launched;
    decodes then overlap again; the tokens are the synchronous engine's."""
    prompts = random_prompts([6, 11, 3], seed=21)
    want = [o.token_ids for o in tiny_model.generate_outputs(prompts, [greedy(6)] * 3)]
    llm = LLM(tiny_model, block_size=4, num_blocks=60, async_scheduling=True)
    llm.add_request(prompts[0], greedy(6), request_id="0")
    assert llm.step() == []  # the prefill is launched, its token still on the device
    outs = llm.step()
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    assert llm.stats.steps == 1 and llm._inflight is None  # nothing launched in between
    finish_with_two_more(llm, prompts, outs, want)
    assert overlap_calls and max(overlap_calls) > 0


def test_a_prefill_still_on_the_gpu_gets_its_first_decode_launched_behind_it(tiny_model,
                                                                            monkeypatch,
                                                                            overlap_calls):
    """While a step of first tokens still runs on the GPU (on_gpu: True here on a CPU) and no
    request waits, the same call launches the next step (their first decode, its input the
    prefill's tokens on the device) before it reads the first tokens; with a request waiting
    it does not (the next step admits it: its first token first). Tokens as the synchronous
    engine's, on a mixed workload too."""
    from layer4_algorithms.launched_step import LaunchedStep  # noqa: PLC0415

    monkeypatch.setattr(LaunchedStep, "on_gpu", lambda self: True)
    prompts = random_prompts([6, 11, 3], seed=21)
    want = [o.token_ids for o in tiny_model.generate_outputs(prompts, [greedy(6)] * 3)]
    llm = LLM(tiny_model, block_size=4, num_blocks=60, async_scheduling=True)
    llm.add_request(prompts[0], greedy(6), request_id="0")
    outs = llm.step()  # the prefill, its first decode behind it, the first token read
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    assert llm.stats.steps == 2 and llm._inflight is not None
    assert overlap_calls == [1]  # the decode's input: the prefill's token on the device
    finish_with_two_more(llm, prompts, outs, want)
    one_seat = LLM(tiny_model, block_size=4, num_blocks=60, async_scheduling=True,
                   max_num_seqs=1)
    one_seat.add_request(prompts[0], greedy(1), request_id="0")
    one_seat.add_request(prompts[1], greedy(6), request_id="1")
    assert one_seat.step() == [] and one_seat.stats.steps == 1  # "1" waits: nothing early
    lengths = [1, 2, 30, 11, 4, 8, 19]
    ps = random_prompts(lengths, seed=7)
    params = [greedy(m) for m in (7, 1, 12, 3, 9, 2, 15)]
    want, got, _ = run_both(tiny_model, ps, params, block_size=3, num_blocks=200,
                            max_num_batched_tokens=13, max_num_seqs=5)
    assert tokens(got) == tokens(want)


def test_the_flag_resolves_and_rejects_what_it_cannot_do(tiny_model):
    assert LLM(tiny_model, num_blocks=32).config.async_scheduling is False  # a CPU model
    assert LLM(tiny_model, num_blocks=32, async_scheduling=True).config.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(async_scheduling=True, speculative=dict(method="ngram", k=2))
    spec = LLM(tiny_model, num_blocks=64, speculative=dict(method="ngram", k=2))
    assert spec.config.async_scheduling is False


def test_pinned_staging_double_buffers_and_copies_right():
    """HostStaging on the CPU copies plainly; the values and shapes survive either way."""
    import layer3_model as l3
    st = l3.HostStaging("cpu")
    with pytest.raises(ValueError, match="arenas"):
        l3.HostStaging("cpu", arenas=1)
    for n in (1, 5, 5000):
        st.next_step()
        a = np.arange(n, dtype=np.int64).reshape(-1, 1)
        assert torch.equal(st.to_device(a), torch.arange(n).view(-1, 1))


@pytest.fixture
def checked_mirror(monkeypatch):
    """Every step's mirrored block table is checked against the one built from the lists."""
    from layer4_algorithms.kv import padded_table
    gather, checks = MR.BlockTableMirror.gather, []

    def checked(self, seqs):
        got = gather(self, seqs)
        if got is not None:
            want = padded_table([q.block_table for q in seqs])
            assert np.array_equal(got[0], want) and got[1].tolist() == [
                len(q.block_table) for q in seqs]
            checks.append(len(seqs))
        return got
    monkeypatch.setattr(MR.BlockTableMirror, "gather", checked)
    one_pass = MR.decode_inputs

    def checked_decode(mirror, group, plain=False):  # a decode step's rows, same mirror
        got = one_pass(mirror, group, plain)
        if got is not None:
            seqs = [s.seq for s in group]
            if plain:  # the scheduler's word for it (no table changed): it held, and all sample
                assert got.rows == list(range(len(group)))
                assert all(s.num_new_tokens == 1 and not s.spec_token_ids for s in group)
            assert np.array_equal(got.table, padded_table([q.block_table for q in seqs]))
            assert got.lens.tolist() == [len(q.block_table) for q in seqs]
            assert got.context_lens.tolist() == [s.context_len for s in group]
            checks.append(len(seqs))
        return got
    monkeypatch.setattr(MR, "decode_inputs", checked_decode)
    return checks


@pytest.mark.parametrize("mode", [False, True])
def test_block_table_mirror_follows_cow_preemption_prefix_hits_and_rollback(tiny_model, mode,
                                                                            checked_mirror):
    shared = random_prompts([9], seed=21)[0]
    prompts = [shared + p for p in random_prompts([2, 5, 1, 7, 3, 4], seed=22)]
    params = [SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=10, ignore_eos=True),
              greedy(14), greedy(6), greedy(11), greedy(9), greedy(13)]
    llm = LLM(tiny_model, block_size=4, num_blocks=14, max_num_seqs=6,
              max_num_batched_tokens=10, async_scheduling=mode)
    llm.generate(prompts, params)
    assert llm.stats.preemptions > 0 and checked_mirror
    assert_no_leak(llm)
    spec = LLM(tiny_model, block_size=4, num_blocks=60, speculative=dict(method="ngram", k=3))
    spec.generate(prompts[1:], params[1:])  # rejected drafts: tables truncated
    assert spec.stats.spec_proposed > spec.stats.spec_accepted
    assert_no_leak(spec)
