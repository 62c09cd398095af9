"""On two and four GPUs: TP=2 and TP=4 with CUDA graphs on every rank (the collectives inside
the graphs, the step's inputs broadcast inside them, the step message through shared memory)
gives TP=1's greedy tokens and logprobs within tolerance; a worker that dies or hangs in a
graph step fails rank 0 with one clear error within the timeout, every worker gone."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.tensor_parallel.graphs import TPGraphRunner

from .engine_checks import assert_prompts_same_or_near_tie

l3 = l5.engine.executor
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be", "KING LEAR.\n",
           "MACBETH.\nIs this a dagger", "PORTIA.\nThe quality of mercy", "OTHELLO.\n", "IAGO.\n",
           "PUCK.\nIf we shadows"]  # 9: buckets 1, 2, 4, 8 and 16 all replay as sequences finish
LOGPROB_ATOL = 2e-3  # fp32; the all-reduce sums in another order (~1e-5 on logits)


def _run(llm):
    # different lengths: the batch shrinks through the buckets as sequences finish
    params = [l5.SamplingParams(temperature=0.0, max_tokens=8 + 2 * i, ignore_eos=True,
                                logprobs=1) for i in range(len(PROMPTS))]
    res = llm.generate(PROMPTS, params)
    return ([o.outputs[0].token_ids for o in res],
            [[lp.logprob for lp in o.outputs[0].logprobs] for o in res])


def _plain_tokens(llm):
    params = l5.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _no_workers():
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not [p for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.multigpu
def test_tp2_cuda_graphs_match_tp1_cuda_graphs():
    path = l3.course_model_dir("target")
    kw = dict(dtype="float32", device="cuda", num_blocks=256, max_num_seqs=16, cuda_graph=True)
    ref = l5.LLM(path, **kw)
    want, want_lp = _run(ref)
    want_plain = _plain_tokens(ref)
    with l5.LLM(path, tensor_parallel_size=2, **kw) as tp:
        graph = tp.runner.graph
        assert isinstance(graph, TPGraphRunner) and graph.captured
        assert sorted(graph.graphs) == [1, 2, 4, 8, 16]
        sent = tp.tp_group.ring.count
        got, got_lp = _run(tp)
        got_plain = _plain_tokens(tp)
        assert tp.tp_group.ring.count - sent > 40  # the decode steps went through the ring
    assert_prompts_same_or_near_tie(ref, PROMPTS, want, got)
    assert_prompts_same_or_near_tie(ref, PROMPTS, want_plain, got_plain)
    for a, b, la, lb in zip(want, got, want_lp, got_lp, strict=True):
        n = next((k for k in range(len(a)) if a[k] != b[k]), len(a))
        torch.testing.assert_close(torch.tensor(lb[:n]), torch.tensor(la[:n]),
                                   atol=LOGPROB_ATOL, rtol=0)
    assert _no_workers()


# Why TP=2 may pick another token than TP=1 in bf16, and what is checked instead. bf16 logits
# near 4 are 1/32 apart, and random weights over a 128k vocabulary give flat logits (std ~0.9),
# so TP=1's top two are within an ulp or two at about every other token; TP=2 sums the
# row-parallel products in another order (each half rounded to bf16 before the all-reduce), so
# such ties flip. Measured on a CPU (gloo, this model, eager graph path): 3 of 4 prompts flipped
# at token 1 or 2, TP=1's margins 0, 0 and 0.0625; prefill logits differ by at most 0.07 (mean
# 0.0095); in fp32 the same run gives equal tokens and logprobs within 3e-6. So: every prompt's
# full-vocabulary prefill logits within BF16_LOGITS_ATOL (max) and BF16_LOGITS_MEAN (mean abs),
# logprobs within BF16_LOGPROB_ATOL until the first differing token, and that token a near-tie:
# TP=1's margin within 2 x BF16_LOGITS_ATOL (a flip needs the two logits' errors to close it).
BF16_LOGITS_ATOL = 0.15
BF16_LOGITS_MEAN = 0.03
BF16_NEAR_TIE = 2 * BF16_LOGITS_ATOL
BF16_LOGPROB_ATOL = 0.1


def bf16_diagnosis(ref_llm, prompts, r1, r2, tp: int = 2) -> list[str]:
    """Per prompt: where TP=tp's greedy tokens first differ from TP=1's, TP=1's margin there
    (its logits of the common prefix) and the largest logprob gap before; problems listed."""
    problems = []
    for i, (a, b) in enumerate(zip(r1, r2, strict=True)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((k for k in range(len(ta)) if ta[k] != tb[k]), len(ta))
        la = torch.tensor([lp.logprob for lp in a.outputs[0].logprobs[:n]])
        lb = torch.tensor([lp.logprob for lp in b.outputs[0].logprobs[:n]])
        gap = float((la - lb).abs().max()) if n else 0.0
        line = f"prompt {i}: tokens equal for {n}/{len(ta)}, logprob gap {gap:.3g}"
        bad = gap > BF16_LOGPROB_ATOL
        if n < len(ta):
            last = ref_llm.prompt_logits([prompts[i] + ta[:n]])[0][-1].float()
            margin = float(last[ta[n]] - last[tb[n]])
            top = float(last.max())
            line += (f"; token {n}: TP=1 {ta[n]}, TP={tp} {tb[n]}, TP=1's margin {margin:.4g} "
                     f"(top logit {top:.4g})")
            bad = bad or abs(margin) > BF16_NEAR_TIE
        print(line)
        if bad:
            problems.append(line)
    return problems


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: the fused decode kernels
def test_tp2_bf16_llama_shape_graphs_equal_tp1_tokens(backend):
    """bf16 at Llama-3.2-1B's widths (4 layers): every prompt's full-vocabulary prefill logits
    within bf16 tolerance of TP=1's; greedy tokens (decode steps replayed from the graphs) equal
    until a near-tie of TP=1's own logits, logprobs within tolerance until then."""
    bf16_tp_equals_tp1(backend, 2, "torch")


@pytest.mark.multigpu
@pytest.mark.parametrize("tp_backend", ["torch", "ours"])  # ours: layer 2's peer all-reduce
def test_tp4_bf16_llama_shape_graphs_equal_tp1_tokens(tp_backend):
    """The same at TP=4 (8 KV heads: 2 per rank), with NCCL's and with our all-reduce."""
    if torch.cuda.device_count() < 4:
        pytest.skip(f"TP=4 needs 4 GPUs; {torch.cuda.device_count()} visible")
    bf16_tp_equals_tp1("triton", 4, tp_backend)


def bf16_tp_equals_tp1(backend: str, tp: int, tp_backend: str,
                       one_sequence_too: bool = False) -> None:
    """TP=tp's prefill logits within bf16 tolerance of TP=1's and its greedy tokens equal (or a
    near tie) on a 4-layer Llama-3.2-1B-shaped model with CUDA graphs: four sequences a step,
    then (one_sequence_too) one, which takes the fused GEMV decode path."""
    config = l3.ModelConfig.from_dict(dict(l3.LLAMA_3_2_1B, num_hidden_layers=4))
    model = l3.Model(l3.random_model(config, backend=backend, dtype=torch.bfloat16,
                                     device="cuda", seed=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 17, 33, 64)]
    runs = (prompts, prompts[1:2]) if one_sequence_too else (prompts,)
    params = l5.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(num_blocks=64, max_num_seqs=8, cuda_graph=True, max_model_len=256)
    ref = l5.LLM(model, **kw)
    want = [ref.generate(p, params) for p in runs]
    want_logits = ref.prompt_logits(prompts)
    with l5.LLM(model, tensor_parallel_size=tp, tp_backend=tp_backend, **kw) as llm:
        assert llm.runner.graph.captured
        got = [llm.generate(p, params) for p in runs]
        got_logits = llm.prompt_logits(prompts)
    problems = []
    for i, (w, x) in enumerate(zip(want_logits, got_logits, strict=True)):
        d = (w.float() - x.float()).abs()
        line = (f"prompt {i}: prefill logits |TP={tp} - TP=1| max {float(d.max()):.3g}, mean "
                f"{float(d.mean()):.3g} (logits' std {float(w.float().std()):.3g})")
        print(line)
        if float(d.max()) > BF16_LOGITS_ATOL or float(d.mean()) > BF16_LOGITS_MEAN:
            problems.append(line)
    for p, r1, r2 in zip(runs, want, got, strict=True):
        problems += bf16_diagnosis(ref, p, r1, r2, tp)
    assert not problems, "\n".join(problems)


@pytest.mark.multigpu
def test_a_second_engine_with_our_all_reduce_in_one_process_starts():
    """Torch symmetric memory numbers its rendezvous exchanges per process: rank 0 has made
    some for the first engine, the second engine's fresh workers none; it must still
    rendezvous (it waited for keys never written)."""
    for tp in sorted({2, min(4, torch.cuda.device_count())}):
        with _tiny_tp(tp, tp_backend="ours") as llm:
            out = llm.generate([[1, 2, 3], [4, 5]], l5.SamplingParams(temperature=0.0,
                                                                    max_tokens=4))
            assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    with _tiny_tp(2, tp_backend="ours") as llm:  # and the same size again
        assert llm.generate([[1, 2]], l5.SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert _no_workers()


def _tiny_tp(tp: int, timeout: float = 60.0, **kw):
    config = l3.ModelConfig(model_type="llama", vocab_size=97, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, head_dim=16, max_position_embeddings=128)
    model = l3.Model(l3.random_model(config, seed=2, device="cuda"))
    return l5.LLM(model, tensor_parallel_size=tp, cuda_graph=True, num_blocks=32, max_num_seqs=4,
                  tp_timeout_s=timeout, **kw)


def _tiny_tp2(fault: str, timeout: float, start: float | None = None):
    return _tiny_tp(2, timeout, _tp_faults={1: fault}, tp_start_timeout_s=start)


def _fail_in_a_child(fault: str, timeout: float, answer, start: float | None = None) -> None:
    """Rank 0 in a process of its own: after a hang its GPU stream stays stuck in the all-reduce
    (nothing in-process can free it), so a real server's rank 0 reports and exits, and its
    supervisor starts a new one. This process does the same: the error, then os._exit."""
    llm = _tiny_tp2(fault, timeout, start)
    start = time.monotonic()
    try:
        llm.generate([[1, 2, 3], [4, 5]], l5.SamplingParams(temperature=0.0, max_tokens=4))
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    llm.close()
    alive = [p.pid for p in multiprocessing.active_children() if p.name.startswith("l5-rank")]
    answer.put((error, elapsed, alive))
    answer.close()
    answer.join_thread()
    os._exit(0)


@pytest.mark.multigpu
def test_worker_dying_in_a_cuda_graph_step_fails_rank0():
    timeout = 20.0
    llm = _tiny_tp2("graph-die", timeout)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel") as info:
        llm.generate([[1, 2, 3], [4, 5]], l5.SamplingParams(temperature=0.0, max_tokens=4))
    elapsed = time.monotonic() - start
    llm.close()
    assert elapsed < timeout + 10, elapsed
    assert "rank 1" in str(info.value), str(info.value)
    assert _no_workers()


@pytest.mark.multigpu
@pytest.mark.parametrize("step,start", [(15.0, None), (5.0, 120.0)])
def test_worker_hanging_in_a_cuda_graph_step_fails_rank0_within_the_timeout(step, start):
    """One limit for start-up and steps (the default), and the two apart: a short step limit
    under a long start-up one (NCCL's groups switch to the step limit once every rank is up)."""
    ctx = multiprocessing.get_context("spawn")
    answer = ctx.Queue()
    child = ctx.Process(target=_fail_in_a_child, args=("graph-hang", step, answer, start),
                        name="tp-rank0", daemon=False)
    child.start()
    try:
        error, elapsed, alive = answer.get(timeout=step + 90)  # + start-up and capture
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert "tensor-parallel" in error and "within" in error, error
    assert "step limit" in error and "start-up limit" not in error, error
    assert elapsed < step + 10, elapsed
    assert not alive, f"workers left after close: {alive}"
    assert child.exitcode == 0, child.exitcode
