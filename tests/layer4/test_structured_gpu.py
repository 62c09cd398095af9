"""Structured outputs on a GPU: the course model in bf16 with CUDA-graph decode steps (the mask
is applied to the graph's output buffer), beside unconstrained requests, and under draft-model
speculation. Each output must parse and be accepted, token by token, by a fresh matcher of its
grammar (the grammars themselves are checked against the schemas with `jsonschema` on the CPU,
test_structured.py; the GPU machine need not have jsonschema)."""
from __future__ import annotations

import json

import pytest
import torch

import layer3_model as l3
import layer4_algorithms as l4

from .l4_helpers import random_bitmask_case as random_case
from .schemas import SCHEMAS

pytestmark = pytest.mark.gpu
SO = l4.StructuredOutputsParams


@pytest.fixture(scope="module")
def gpu_model() -> l3.Model:
    return l3.load(l3.course_model_dir("target"), device="cuda", dtype="bfloat16")


def accepted(llm: l4.LLM, spec: SO, token_ids: list[int]) -> bool:
    """A fresh matcher takes them all, token by token."""
    state = l4.GrammarCompiler.for_model(llm.model).state(spec)
    return all(state.accept(t) for t in token_ids) and state.is_accepting


@pytest.mark.parametrize("n, r, vocab, dtype", [(48, 32, 128256, torch.float32),
                                                (32, 32, 4096, torch.float32),
                                                (9, 4, 49152, torch.bfloat16),
                                                (3, 1, 70, torch.float16)])
def test_bitmask_kernel_equals_the_torch_reference(n, r, vocab, dtype):
    """The compiled Triton kernel against the torch path on the GPU: the same -inf positions,
    every other logit bit-identical, rows not in `rows` untouched; and its time beside the
    torch path's (printed: the kernel should be one launch, a few microseconds)."""
    from triton.testing import do_bench

    logits, bitmask, rows, want = random_case(n, r, vocab, dtype, device="cuda", seed=n)
    got = l4.apply_token_bitmask_(logits.clone(), bitmask, rows, impl="triton")
    ref = l4.apply_token_bitmask_(logits.clone(), bitmask, rows, impl="torch")
    assert torch.equal(got, want.cuda()) and torch.equal(ref, want.cuda())
    work = logits.clone()
    t_kernel = do_bench(lambda: l4.apply_token_bitmask_(work, bitmask, rows, impl="triton"))
    t_torch = do_bench(lambda: l4.apply_token_bitmask_(work, bitmask, rows, impl="torch"))
    print(f"\napply ({r} of {n} rows, V={vocab}, {dtype}): triton {1e3 * t_kernel:.1f} us, "
          f"torch {1e3 * t_torch:.1f} us", flush=True)


def test_mask_graphs_replay_the_apply_and_the_masked_argmax():
    """MaskGraphs on a GPU: two host arenas in turn (as TokenMasks alternates them), each
    captured once seen WARM times, then replayed; every launch masks exactly, and with an
    argmax buffer (the decode graph's input ids) each replay leaves the masked rows' argmax
    there, for new bitmask contents written into the same pinned arenas."""
    mg = l4.structured.mask_graph
    V, N, R = 4096, 32, 20
    W = (V + 31) // 32
    n = R * W + R
    hosts = [torch.empty(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
    dev = torch.empty(n, dtype=torch.int32, device="cuda")
    logits = torch.empty(N, V, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(N, dtype=torch.int64, device="cuda")
    graphs = mg.MaskGraphs()
    for step in range(2 * (mg.WARM + 4)):
        raw, bitmask, rows, want = random_case(N, R, V, torch.bfloat16, seed=step)
        host = hosts[step % 2]
        host[:R * W] = bitmask.view(-1)
        host[R * W:n] = rows.to(torch.int32)
        logits.copy_(raw.cuda())
        got = graphs.run(logits, host, dev, R, n, W, argmax=ids)
        assert graphs.failed is None, graphs.failed
        assert torch.equal(logits.cpu(), want)
        if got is not None:
            assert got is ids and torch.equal(ids.cpu(), want.float().argmax(-1))
    assert graphs.stats["captures"] == 2 and graphs.stats["replays"] == 8, graphs.stats


def test_constrained_rows_under_cuda_graphs_beside_free_ones(gpu_model):
    llm = l4.LLM(gpu_model, num_blocks=256, max_num_seqs=32, cuda_graph=True)
    schemas = SCHEMAS[:24]
    specs = [SO(json=s) for s in schemas]
    params = [l4.SamplingParams(temperature=0.8, seed=i, max_tokens=96, structured_outputs=sp)
              for i, sp in enumerate(specs)]
    params += [l4.SamplingParams(temperature=0, max_tokens=32)] * 8
    outs = llm.generate(["HAMLET.\n"] * len(params), params)
    for sp, o in zip(specs, outs, strict=False):
        c = o.outputs[0]
        assert c.finish_reason == "eos", (sp.json, c.text)
        json.loads(c.text)
        assert accepted(llm, sp, list(c.token_ids)), c.text
    assert all(len(o.outputs[0].token_ids) == 32 or o.outputs[0].finish_reason != "length"
               for o in outs[len(specs):])
    # the masked steps, rows, the engine's fill and apply seconds
    print(f"\nmasks under CUDA graphs: {llm.masks.stats}", flush=True)


def test_constrained_rows_under_draft_speculation_on_cuda(gpu_model):
    spec_cfg = dict(method="draft", k=3, draft=str(l3.course_model_dir("draft")))
    llm = l4.LLM(gpu_model, num_blocks=256, max_num_seqs=8, speculative=spec_cfg)
    specs = [SO(json=s) for s in SCHEMAS[10:18]]
    outs = llm.generate(["ROMEO.\n"] * len(specs),
                        [l4.SamplingParams(temperature=0, max_tokens=96, structured_outputs=sp)
                         for sp in specs])
    assert llm.stats.spec_proposed > 0
    for sp, o in zip(specs, outs, strict=True):
        json.loads(o.outputs[0].text)
        assert accepted(llm, sp, list(o.outputs[0].token_ids)), o.outputs[0].text


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_constrained_rows_with_the_apply_from_cuda_graphs(gpu_model, temperature):
    """Under CUDA-graph decoding with async scheduling the apply's copy + kernel replay from
    CUDA graphs (mask_graph.py; greedy: with the masked argmax written over the decode
    graph's input ids): the outputs equal those of plain launches, each accepted token by
    token by a fresh matcher, and the graphs were captured (the steady batch's two arenas)
    and replayed."""
    specs = [SO(json=s) for s in SCHEMAS[:16]]
    params = [l4.SamplingParams(temperature=temperature, seed=i, max_tokens=96,
                                structured_outputs=sp) for i, sp in enumerate(specs)]

    def run(graphs: bool):
        llm = l4.LLM(gpu_model, num_blocks=256, max_num_seqs=32, cuda_graph=True)
        assert llm.masks.graphs is not None and llm.config.async_scheduling  # (the default)
        if not graphs:
            llm.masks.graphs = None
        outs = llm.generate(["HAMLET.\n"] * len(specs), params)
        return llm, [list(o.outputs[0].token_ids) for o in outs]

    ref, want = run(False)
    llm, got = run(True)
    assert got == want
    for sp, ids in zip(specs, got, strict=True):
        assert accepted(ref, sp, ids)
    assert llm.masks.graphs.failed is None, llm.masks.graphs.failed
    st = llm.masks.graphs.stats
    assert st["captures"] >= 2 and st["replays"] > 0, st  # (both arenas)
    print(f"\nmasks ({temperature=}) under CUDA graphs: {llm.masks.stats}, {st}", flush=True)
