"""ModelRunner: pass planning, batched sampling, logits rows for speculation; and the engine's
speculator hook end to end with an oracle-and-noise proposer (greedy output must not change)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import layer3_model as l3
from layer4_algorithms import (
    LLM,
    CudaGraphRunner,
    SamplingParams,
    ScheduledSeq,
    SchedulerOutput,
    Sequence,
    SpecCounts,
)

from .l4_helpers import TINY, assert_no_leak, greedy, random_prompts


def sched(query_len: int, context: int, spec: int = 0) -> ScheduledSeq:
    s = Sequence(0, "0", [1] * (context + query_len), SamplingParams())
    return ScheduledSeq(s, query_len, context, num_lookahead=spec, spec_token_ids=[2] * spec)


def test_plan_passes_keeps_padded_attention_bounded(tiny_model):
    llm = LLM(tiny_model, num_blocks=16)
    runner = llm.runner
    step = [sched(1, 40), sched(30, 0), sched(1, 7), sched(20, 5), sched(1, 3, spec=2)]
    assert runner.plan_passes(step) == [[0, 1, 2, 3, 4]]  # small: one mixed pass
    heads = tiny_model.config.num_attention_heads
    # the 30-token prefill alone; the 20-token chunk + the verify
    runner.attn_bytes_limit = heads * 32 * 32 * 4
    assert runner.plan_passes(step) == [[0, 2], [1], [3, 4]]
    assert runner.padded_attention_bytes([step[0], step[2]]) == 0  # decodes use decode_attention
    runner.attn_bytes_limit = 1
    assert runner.plan_passes(step) == [[0, 2], [1], [3], [4]]


def test_the_triton_backend_keeps_a_mixed_step_in_one_pass():
    """Its flash kernels pad nothing, so no limit splits a step; the torch backend's padded
    path is split as before, and so is the triton backend's where a layer has a sliding
    window (it leaves those to the padded path)."""
    config = l3.ModelConfig.from_dict(TINY)
    net = l3.random_model(config, backend="triton", seed=0)
    runner = LLM(l3.Model(net, None), num_blocks=16).runner
    runner.attn_bytes_limit = 1
    step = [sched(1, 40), sched(30, 0), sched(1, 7), sched(20, 5), sched(1, 3, spec=2)]
    assert runner.plan_passes(step) == [[0, 1, 2, 3, 4]]
    net.set_backend("torch")
    assert runner.plan_passes(step) == [[0, 2], [1], [3], [4]]
    windows = (None,) * (config.num_hidden_layers - 1) + (8,)
    windowed = dataclasses.replace(config, layer_windows=windows)
    assert l3.pads_prefill_attention(l3.random_model(windowed, backend="triton", seed=0))


def test_sample_matches_layer3_row_by_row(tiny_model):
    llm = LLM(tiny_model, num_blocks=16)
    logits = torch.randn(4, 97, generator=torch.Generator().manual_seed(0))
    params = [l3.SamplingParams(temperature=0), l3.SamplingParams(temperature=0.7, seed=1),
              l3.SamplingParams(temperature=0), l3.SamplingParams(temperature=1.3, top_k=5, seed=2)]
    got = llm.runner.sample(list(logits), params, [l3.make_generator(p) for p in params])
    want = l3.sample(logits, params, [l3.make_generator(p) for p in params]).tolist()
    assert got == want and llm.runner.sample([], [], []) == []
    # (N, V) tensor
    assert llm.runner.sample(logits, params, [l3.make_generator(p) for p in params]) == want
    greedy_only = [l3.SamplingParams(temperature=0)] * 4
    assert llm.runner.sample(logits, greedy_only, [None] * 4) == logits.argmax(-1).tolist()


class OracleSpeculator:
    """Proposes the reference continuation with some tokens corrupted; accepts greedily
    (draft j accepted while it equals the target's argmax at j)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], k: int, seed: int = 0) -> None:
        self.reference, self.num_lookahead_slots, self.rng = reference, k, random.Random(seed)
        self.released: list[int] = []
        self.counts = SpecCounts()  # the Speculator protocol: verify records what it accepted

    def propose(self, out) -> None:
        for s in out.scheduled:
            if s.num_lookahead:
                full = self.reference[tuple(s.seq.prompt_ids)]
                done = len(s.seq.output_ids)
                guess = full[done:done + self.rng.randint(0, s.num_lookahead)]
                s.spec_token_ids = [t if self.rng.random() < 0.8 else (t + 1) % 97 for t in guess]

    def verify(self, items):
        result = {}
        for s, rows in items:
            best = rows.argmax(-1).tolist()
            j = 0
            while j < len(s.spec_token_ids) and s.spec_token_ids[j] == best[j]:
                j += 1
            result[s.seq.seq_id] = s.spec_token_ids[:j] + [best[j]]
            self.counts.record(len(s.spec_token_ids), j)
        return result

    def release(self, seq) -> None:
        self.released.append(seq.seq_id)


def test_speculator_hook_keeps_greedy_outputs_and_frees_rejected_slots(tiny_model):
    prompts = random_prompts([4, 13, 7, 21], seed=4)
    params = [greedy(m) for m in (12, 9, 15, 6)]
    want = [o.token_ids for o in tiny_model.generate_outputs(prompts, params)]
    spec = OracleSpeculator({tuple(p): w for p, w in zip(prompts, want, strict=True)}, k=3)
    llm = LLM(tiny_model, block_size=3, num_blocks=40, max_num_batched_tokens=10, speculator=spec)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    st = llm.stats
    assert st.spec_proposed > 0 and 0 < st.spec_accepted < st.spec_proposed
    assert 0 < st.acceptance_rate < 1
    plain = LLM(tiny_model, block_size=3, num_blocks=40, max_num_batched_tokens=10)
    plain.generate(prompts, params)
    assert st.steps < plain.stats.steps  # accepted drafts saved steps
    assert len(spec.released) == len(prompts)  # every row given back
    assert_no_leak(llm)


def test_graph_runner_path_gives_the_same_outputs(tiny_model):
    """The CUDA-graph decode path of the runner, run eagerly on the CPU (capture=False): same
    buffers, padding rows and slot mapping as on a GPU; decode steps must go through it."""
    prompts = random_prompts([4, 13, 7, 21, 2], seed=8)
    params = [greedy(m) for m in (12, 9, 15, 6, 3)]
    want = [o.token_ids for o in tiny_model.generate_outputs(prompts, params)]
    llm = LLM(tiny_model, block_size=4, num_blocks=18, max_num_batched_tokens=9, max_num_seqs=4)
    llm.runner.graph = CudaGraphRunner(tiny_model.net, llm.cache, 4, -(-llm.max_model_len // 4),
                                       capture=False)
    calls = []  # the engine's decode steps fill the graph's inputs from the host (run_host)
    run = llm.runner.graph.run_host
    llm.runner.graph.run_host = lambda *a, **k: (calls.append(a[0].shape[0]), run(*a, **k))[1]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert calls and max(calls) > 1 and llm.stats.preemptions > 0
    assert_no_leak(llm)


def _awkward_rows(device: str) -> list[torch.Tensor]:
    """Rows torch.argmax is exact on and a split argmax could get wrong: ties across the row
    (the first wins), NaN (beats +inf), all -inf (index 0), a masked row (grammar: -inf but
    one), bf16 and fp32, a strided view."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 128256, generator=g)
    x[0, 5] = x[0, 100000] = 40.0
    x[1, 7], x[1, 3] = float("inf"), float("nan")
    x[1, 128255] = float("nan")
    x[2] = float("-inf")
    x[3] = float("-inf")
    x[3, 128000] = -5.0
    x = x.to(device)
    return [x, x[:1], x.to(torch.bfloat16), x[:, ::2], x[4:], x[:0]]


def test_greedy_tokens_is_torch_argmax():
    from layer4_algorithms.step_sampling import greedy_tokens
    for x in _awkward_rows("cpu"):
        assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))


@pytest.mark.gpu
def test_greedy_tokens_on_gpu_is_torch_argmax():
    """On a GPU the runner's greedy pick is layer 1's split argmax: the same tokens as
    torch.argmax (the first index of the max, NaN the largest), twice (its counters reset)."""
    from layer4_algorithms.step_sampling import greedy_tokens
    for x in _awkward_rows("cuda"):
        for _ in range(2):
            assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))


def test_a_decode_step_takes_the_one_pass_inputs_with_the_general_paths_results(tiny_model,
                                                                               monkeypatch):
    """A step of one-token sequences (tokens on the host and on the device, a one-token
    prompt chunk that does not sample) runs from decode_inputs' one pass: the same logits
    and rows as the general path's (input_ids, lengths, mirror gather)."""
    from layer4_algorithms import model_runner

    def step(llm):
        seqs = []
        for i, n in enumerate((5, 9, 3)):
            s = Sequence(i, str(i), list(range(10 + i, 10 + i + n)), SamplingParams())
            s.row, s.block_table = i, [2 * i, 2 * i + 1]
            seqs.append(s)
        seqs[1].num_pending, seqs[1].pending_index = 1, 0  # its input token is on the device
        out = SchedulerOutput([ScheduledSeq(seqs[0], 1, 4), ScheduledSeq(seqs[1], 1, 9, pending=0),
                               ScheduledSeq(seqs[2], 1, 1)])  # seq 2: a chunk, no sample
        return llm.runner.execute(out, torch.tensor([42]))

    fast = step(LLM(tiny_model, num_blocks=16))
    monkeypatch.setattr(model_runner, "decode_inputs", lambda *a: None)
    slow = step(LLM(tiny_model, num_blocks=16))
    assert fast.row == slow.row == [0, 1, None]
    torch.testing.assert_close(fast.last, slow.last)
