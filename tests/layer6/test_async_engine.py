"""Layer 6 AsyncEngine on the course model (CPU): abort frees everything within a step,
preemption under a small KV pool, priority admission, backpressure, timeouts, step errors."""
from __future__ import annotations

import asyncio

import pytest

import layer6_serving as l6

from .helpers import wait_idle

SP = l6.parallel.SamplingParams
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo!\n\nROMEO.\n", "HAMLET.\nTo be, or not to be"]


@pytest.fixture(scope="module")
def engine():
    e = l6.AsyncEngine("course", num_blocks=40, block_size=16, max_num_seqs=8,
                       policy="priority", max_waiting=64)
    yield e
    e.shutdown()


def small_engine(engine, **kw) -> l6.AsyncEngine:
    """Another engine over the module engine's loaded model (no second load)."""
    serving = {k: kw.pop(k) for k in ("policy", "max_waiting") if k in kw}
    if serving.get("policy") == "priority":  # priority is the engine scheduler's
        kw["scheduling"] = "priority"
    return l6.AsyncEngine(l6.parallel.LLM(engine.llm.model, num_blocks=40, **kw), name="small",
                          **serving)


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_stream_deltas_add_up_to_the_whole_output(engine):
    async def go():
        p = SP(temperature=0, max_tokens=24)
        parts = [d.text async for o in await engine.generate(PROMPTS[0], p) for d in o.deltas]
        whole = await (await engine.generate(PROMPTS[0], p)).collect()
        return "".join(parts), whole
    streamed, whole = run(go())
    assert streamed == whole.deltas[0].text and whole.completion_tokens == 24
    assert whole.deltas[0].finish_reason == "length" and whole.metrics.ttft_s > 0


def test_abort_frees_blocks_and_sequences_within_one_step(engine):
    async def go():
        streams = [await engine.generate(p, SP(temperature=0.8, max_tokens=200, ignore_eos=True))
                   for p in PROMPTS]
        for s in streams:
            await s.__anext__()  # each has started
        assert engine.snapshot.kv_blocks_used > 0 or engine.snapshot.running > 0
        before = engine.snapshot.steps
        for s in streams:
            await s.aclose()
        await wait_idle(engine)
        return engine.snapshot.steps - before
    steps = run(go())
    assert steps <= 1, f"the aborts took {steps} steps to apply"
    assert engine.snapshot.kv_blocks_used == 0 and engine.snapshot.running == 0
    out = run(_collect(engine, PROMPTS[1], SP(temperature=0, max_tokens=5)))
    assert out.completion_tokens == 5  # the next request still works


async def _collect(engine, prompt, params, **kw):
    return await (await engine.generate(prompt, params, **kw)).collect()


def test_workload_bigger_than_the_kv_cache_preempts_and_finishes(engine):
    pre = engine.snapshot.preemptions
    # 8 sequences x ~(10 + 150) tokens need ~80 blocks of 16; the pool has 40.
    params = SP(temperature=0, max_tokens=150, ignore_eos=True)

    async def go():
        return await asyncio.gather(*[_collect(engine, PROMPTS[i % 3], params) for i in range(8)])
    outs = run(go(), timeout=120)
    assert all(o.completion_tokens == 150 for o in outs)
    assert engine.snapshot.preemptions > pre
    run(wait_idle(engine))
    assert engine.snapshot.kv_blocks_used == 0


def test_priority_overtakes_waiting_requests(engine):
    e = small_engine(engine, max_num_seqs=1, policy="priority")
    try:
        async def go():
            order = []

            async def one(tag, prio):
                await _collect(e, PROMPTS[0], SP(temperature=0, max_tokens=8), priority=prio)
                order.append(tag)
            await asyncio.gather(one("a", 5), one("b", 5), one("c", 5), one("urgent", 0))
            return order
        order = run(go())
        assert order.index("urgent") < order.index("c")
    finally:
        e.shutdown()


def test_backpressure_refuses_beyond_the_waiting_limit(engine):
    e = small_engine(engine, max_num_seqs=1, max_waiting=2)
    try:
        async def go():
            streams, refused = [], None
            for _ in range(6):
                try:
                    streams.append(await e.generate(PROMPTS[0], SP(max_tokens=50)))
                except l6.EngineOverloaded as err:
                    refused = err
                    break
            for s in streams:
                await s.aclose()
            await wait_idle(e)
            return refused
        refused = run(go())
        assert refused is not None and refused.retry_after >= 1
    finally:
        e.shutdown()


def test_timeout_aborts_the_request(engine):
    async def go():
        s = await engine.generate(PROMPTS[0], SP(max_tokens=400, ignore_eos=True), timeout=0.2)
        with pytest.raises(l6.RequestTimeoutError):
            async for _ in s:
                pass
        await wait_idle(engine)
    run(go())
    assert engine.snapshot.kv_blocks_used == 0


def test_bad_requests_are_refused_up_front(engine):
    with pytest.raises(ValueError, match="context"):
        run(engine.generate("x " * 600, SP(max_tokens=4)))
    with pytest.raises(ValueError, match="empty"):
        run(engine.generate([], SP(max_tokens=4)))


def fail_second_call(monkeypatch, owner, name: str, exc: Exception) -> None:
    """owner.name raises exc on its second call (the first step of a request has run)."""
    real, calls = getattr(owner, name), {"n": 0}

    def faulty(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise exc
        return real(*a, **k)
    monkeypatch.setattr(owner, name, faulty)


def assert_request_fails_then_engine_serves(engine, max_tokens: int, match: str) -> None:
    """A long request ends in EngineStepError(match), frees its KV blocks, and the engine
    then serves a new request."""
    async def go():
        s = await engine.generate(PROMPTS[0], SP(max_tokens=max_tokens, ignore_eos=True))
        with pytest.raises(l6.EngineStepError, match=match):
            async for _ in s:
                pass
        await wait_idle(engine)
    run(go())
    assert engine.snapshot.kv_blocks_used == 0
    assert run(_collect(engine, PROMPTS[0], SP(temperature=0, max_tokens=3))).completion_tokens == 3


def test_a_failing_step_fails_its_requests_and_the_engine_lives_on(engine, monkeypatch):
    fail_second_call(monkeypatch, engine.llm, "step", RuntimeError("injected fault"))
    assert_request_fails_then_engine_serves(engine, 50, "injected fault")


def test_a_bug_in_the_loop_fails_its_requests_instead_of_hanging(engine, monkeypatch):
    fail_second_call(monkeypatch, engine.loop, "_deliver", KeyError("a bug"))
    assert_request_fails_then_engine_serves(engine, 30, "engine loop failed")
    assert engine.loop.thread.is_alive()
