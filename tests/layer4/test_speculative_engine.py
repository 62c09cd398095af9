"""Speculation inside core's step loop: Scheduler (lookahead slots, chunked prefill,
preemption) + BlockManager (truncate) + PagedKVCache + ModelRunner, with the EngineSpeculator
proposing and accepting. Greedy output must equal layer 3's plain greedy, and the block
pool must end where it started (rejected slots freed)."""
from __future__ import annotations

import pytest
import torch

import layer3_model as l3
from layer4_algorithms.config import EngineConfig, SpecConfig
from layer4_algorithms.kv.block_manager import BlockManager
from layer4_algorithms.kv.paged_cache import PagedKVCache
from layer4_algorithms.model_runner import ModelRunner
from layer4_algorithms.scheduler import Scheduler
from layer4_algorithms.sequence import Sequence
from layer4_algorithms.spec.engine_hook import EngineSpeculator

PROMPTS = [
    "HAMLET.\nTo be, or not to be, that is the question.\n\nHORATIO.\n",
    "ROMEO.\n",
    "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\nDeny thy father and refuse thy "
    "name.\n\nROMEO.\n",
]


def spec_config(spec) -> EngineConfig:
    return EngineConfig(max_num_seqs=4, max_model_len=256, speculative=spec)


def run_engine(target, spec: EngineSpeculator, params, *, num_blocks=64, block_size=8, budget=64,
               max_num_seqs=4):
    bm = BlockManager(num_blocks, block_size)
    cache = PagedKVCache.for_model(target.config, num_blocks, block_size, dtype=torch.float32)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=256)
    sched = Scheduler(bm, config, num_lookahead_slots=spec.num_lookahead_slots,
                      on_release=[spec.release])
    runner = ModelRunner(target.net, cache, config)
    seqs = [Sequence(i, str(i), target.encode(p), sp, eos_token_ids=target.eos_token_ids,
                     generator=l3.make_generator(sp), decoder=target.tokenizer.decoder())
            for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        spec.propose(out)
        logits = runner.execute(out)
        sampled = spec.verify([(s, lg) for s,
                               lg in zip(out.scheduled, logits, strict=True) if s.spec_token_ids])
        rest = [i for i, s in enumerate(out.scheduled)
                if logits[i] is not None and s.seq.seq_id not in sampled]
        tokens = runner.sample([logits[i][-1] for i in rest],
                               [out.scheduled[i].seq.params for i in rest],
                               [out.scheduled[i].seq.generator for i in rest])
        sampled.update({out.scheduled[i].seq.seq_id: [t] for i,
                        t in zip(rest, tokens, strict=True)})
        sched.postprocess(out, sampled)
        steps += 1
        assert steps < 500
    return seqs, bm, sched, steps


@pytest.mark.parametrize("method,k", [("draft", 3), ("ngram", 4)])
def test_engine_step_with_speculation_equals_plain_greedy(target, method, k):
    params = [l3.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              l3.SamplingParams(temperature=0, max_tokens=17),
              l3.SamplingParams(temperature=0, max_tokens=40, stop=("\n\n",))]
    ref = target.generate_outputs(PROMPTS, params)
    spec = EngineSpeculator.from_config(spec_config(SpecConfig(method=method, k=k)), target)
    seqs, bm, sched, steps = run_engine(target, spec, params, budget=24)  # 24: chunked prefill too
    for s, r in zip(seqs, ref, strict=True):
        assert (s.output_ids, s.text, s.finish_reason) == (r.token_ids, r.text, r.finish_reason)
    st = spec.stats()
    assert st["spec_rounds"] > 0 and st["spec_accepted"] > 0
    assert steps < max(len(r.token_ids) for r in ref)  # speculation saved steps
    bm.reset_prefix_cache()
    # every block came back: truncate freed rejected slots
    assert bm.num_free_blocks == bm.num_blocks


def test_engine_speculation_survives_preemption(target):
    """A pool too small for all three: sequences are preempted and recomputed; the draft's
    rows are released and re-prefilled by themselves; output still equals plain greedy."""
    params = [l3.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] * 3
    ref = target.generate_outputs(PROMPTS, params)
    spec = EngineSpeculator.from_config(spec_config({"method": "draft", "k": 4}), target)
    seqs, bm, sched, _ = run_engine(target, spec, params, num_blocks=16, block_size=8)
    assert sched.num_preemptions > 0
    assert [s.output_ids for s in seqs] == [r.token_ids for r in ref]


def test_engine_sampled_speculation_is_seeded(target):
    params = [l3.SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=20,
                                ignore_eos=True) for s in (1, 2, 3)]

    def once():
        spec = EngineSpeculator.from_config(spec_config({"method": "draft", "k": 3}), target)
        return [s.output_ids for s in run_engine(target, spec, params)[0]], spec.stats()

    (a, st), (b, _) = once(), once()
    assert a == b and all(len(x) == 20 for x in a)
    assert 0 < st["spec_accepted"] < st["spec_proposed"]


def test_spec_config_is_checked():
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpecConfig(method="eagle")
    with pytest.raises(ValueError, match="k must be"):
        SpecConfig(k=0)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_llm_with_speculative_config_equals_plain_greedy(target, method):
    """The engine's own step loop: LLM(speculative=...) builds the EngineSpeculator through
    spec.EngineSpeculator.from_config."""
    from layer4_algorithms import LLM

    params = [l3.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              l3.SamplingParams(temperature=0, max_tokens=17),
              l3.SamplingParams(temperature=0, max_tokens=40, stop=("\n\n",))]
    ref = target.generate_outputs(PROMPTS, params)
    llm = LLM(target, num_blocks=64, block_size=8, max_num_seqs=4, max_model_len=256,
              speculative={"method": method, "k": 3})
    outs = llm.generate(PROMPTS, params)
    for o, r in zip(outs, ref, strict=True):
        c = o.outputs[0]
        assert (c.token_ids, c.text, c.finish_reason) == (r.token_ids, r.text, r.finish_reason)
    assert llm.stats.spec_proposed > 0 and 0 < llm.stats.spec_accepted <= llm.stats.spec_proposed
