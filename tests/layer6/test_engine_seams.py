"""Layer 6 over layer 4's seams: the request's own speculative acceptance in its metrics,
priority passed down to the engine's scheduler, penalties/logprobs refused under
speculation, and shutdown closing the engine it built."""
from __future__ import annotations

import asyncio

import pytest

import layer6_serving as l6

SP = l6.parallel.SamplingParams
PROMPTS = ["ROMEO.\nROMEO.\nROMEO.\n", "JULIET.\nO Romeo, Romeo!\n\nROMEO.\n"]


@pytest.fixture(scope="module")
def engine():
    e = l6.AsyncEngine("course", num_blocks=64, block_size=16, max_num_seqs=4,
                       policy="priority", speculative={"method": "ngram", "k": 3})
    yield e
    e.shutdown()


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_spec_acceptance_is_the_requests_own(engine):
    sp = SP(temperature=0, max_tokens=40)

    async def one(p):
        return await (await engine.generate(p, sp)).collect()

    served = [run(one(p)).metrics.spec_acceptance for p in PROMPTS]  # one at a time
    offline = l6.parallel.LLM(engine.llm.model, num_blocks=64, block_size=16,
                              speculative={"method": "ngram", "k": 3})
    want = [offline.generate([p], sp)[0].metrics.spec_acceptance for p in PROMPTS]
    assert served == want and any(w is not None for w in want)


def test_priority_is_passed_down(engine):
    assert engine.llm.config.scheduling == "priority"
    assert engine.llm.scheduler.policy == "priority"


def test_penalties_and_logprobs_refused_under_speculation(engine):
    async def ask(**kw):
        await engine.generate(PROMPTS[0], SP(max_tokens=4), **kw)

    for kw in (dict(logprobs=2), dict(presence_penalty=1.0), dict(frequency_penalty=0.5)):
        with pytest.raises(ValueError, match="speculative"):
            run(ask(**kw))


def test_shutdown_leaves_a_borrowed_engine_open(engine):
    e = l6.AsyncEngine(engine.llm, name="borrowed")
    e.shutdown()
    assert not engine.llm.closed  # not ours to close
