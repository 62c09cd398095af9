"""Layer 6 on a CUDA GPU: the server over the course model with CUDA-graph decodes gives the
offline engine's greedy text, and a burst of streams completes. Skipped without a GPU."""
from __future__ import annotations

import asyncio

import httpx
import pytest

import layer6_serving as l6

pytestmark = pytest.mark.gpu
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo!\n\nROMEO.\n", "HAMLET.\nTo be, or not to be"]


@pytest.fixture(scope="module")
def gpu_server():
    with l6.start_server(["course"], device="cuda", cuda_graph=True, max_num_seqs=128) as srv:
        yield srv


def test_greedy_over_http_equals_offline_on_gpu(gpu_server):
    engine = gpu_server.engines["course"]
    assert engine.llm.model.device.type == "cuda"
    offline = l6.parallel.LLM(engine.llm.model, num_blocks=256, cuda_graph=True)
    sp = l6.parallel.SamplingParams(temperature=0, max_tokens=32)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, sp)]
    got = [httpx.post(gpu_server.url + "/v1/completions", timeout=60, json={
        "model": "course", "prompt": p, "max_tokens": 32, "temperature": 0}).json()
        ["choices"][0]["text"] for p in PROMPTS]
    assert got == want


def test_burst_of_128_streams_completes_on_gpu(gpu_server):
    vocab = gpu_server.engines["course"].llm.model.config.vocab_size
    from layer6_serving.bench.loadgen import random_prompts, run_load, summarize

    reqs = random_prompts(128, 64, 64, vocab)
    results, dt = asyncio.run(run_load(gpu_server.url, "course", reqs))
    report = summarize(results, dt)
    assert report["completed"] == 128 and report["failed"] == 0
    print(f"\nGPU burst: {report['output_throughput']:.0f} out tok/s, TTFT p50 "
          f"{report['median_ttft_ms']:.1f} ms, TPOT p50 {report['median_tpot_ms']:.2f} ms")


def test_engine_process_on_gpu_gives_the_offline_text(gpu_server):
    """`stack serve`'s layout: the engine (CUDA) in its own process, the server here."""
    engine = gpu_server.engines["course"]
    offline = l6.parallel.LLM(engine.llm.model, num_blocks=256)
    sp = l6.parallel.SamplingParams(temperature=0, max_tokens=32)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, sp)]
    with l6.start_server(["course"], device="cuda", max_num_seqs=64, num_blocks=512,
                         engine_process=True) as srv:
        assert srv.engines["course"].llm is None and srv.engines["course"].alive
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "course", "prompt": PROMPTS, "max_tokens": 32, "temperature": 0})
        assert [c["text"] for c in r.json()["choices"]] == want
