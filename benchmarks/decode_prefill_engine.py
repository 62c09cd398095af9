"""Decode MBU, prefill MFU and engine throughput on one GPU, one part per call, each written
to a JSON file for decode_prefill_engine_summary.py.

    python benchmarks/decode_prefill_engine.py decode  --out DIR  # 1B, batch 1, CUDA graph: MBU
    python benchmarks/decode_prefill_engine.py prefill --out DIR  # 2048 tokens x5: median MFU
                                                                  # (+ through the engine)
    python benchmarks/decode_prefill_engine.py engine  --out DIR  # 256 seqs: tok/s, floor
    ... --prefill-attention cudnn  # a lone prompt's attention by cuDNN (the model and engines)

Llama-3.2-1B's shape with random bf16 weights (nothing downloaded); ceilings from layer 0.
Every timed configuration first runs untimed on its own shapes (the benches' warm-ups), and
the engine workload is timed twice in a row, so a cold-vs-warm difference would show as a
gap between the two runs. --smoke: a tiny model on the CPU (checks the code; no GPU figures).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import time
from pathlib import Path

import torch

import layer3_model as l3
from layer0_hardware import python_loop_ms
from layer3_model import bench as L3B
from layer3_model.bench_rows import prefill_row
from layer3_model.prefill_graph import CudaGraphPrefill
from layer4_algorithms import LLM
from layer4_algorithms.bench import engine as L4B

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)


def device_sync() -> None:
    """Wait for the GPU's queued work: cudaDeviceSynchronize through torch's binding, without
    torch.cuda.synchronize()'s Python device guard (~60-80 us of host time on an H100 box,
    which a timed call followed by this sync would count as the engine's)."""
    torch._C._cuda_synchronize()


def _setup(smoke: bool) -> tuple[l3.LlamaModel, float, float]:
    """The model, copy bandwidth (bytes/s) and bf16 FLOP/s (the CPU smoke test: nominal 1e11)."""
    shape, dev, dtype = dict(l3.LLAMA_3_2_1B), "cuda", torch.bfloat16
    if smoke:
        shape.update(TINY)
        dev, dtype = "cpu", torch.float32
    net = l3.random_model(l3.ModelConfig.from_dict(shape), backend="triton" if not smoke
                          else "torch", dtype=dtype, device=dev)
    if smoke:
        return net, 1e11, 1e11
    c = l3.load_ceilings("cuda")
    return net, c.memory_bandwidth, c.flops["bf16"]


def decode(net, bw: float, _peak: float, smoke: bool, fused_only: bool = False) -> dict:
    """The fused decode path (the triton backend's default) and, from the same run, the
    general path it replaces (ops.decode off: norm, cuBLAS, rope, scatters, SDPA)."""
    P, N = (128, 256) if not smoke else (8, 8)
    graph = not smoke

    def seconds_per_token() -> float:
        return L3B.best_of(lambda: L3B.decode_seconds_per_token(net, prompt_len=P, new_tokens=N,
                                                                cuda_graph=graph))
    spt = seconds_per_token()
    if fused_only:
        moved = L3B.weight_bytes_read(net) + L3B.kv_bytes_per_position(net) * (P + N / 2)
        return {"what": "1B decode bs1, triton backend, CUDA graph", "tokens_per_s": 1 / spt,
                "ms_per_token": spt * 1e3, "MBU": moved / spt / bw, "floor_ms": moved / bw * 1e3}
    l3.comm.kernels.set_decode_pdl(False)  # the fused kernels without programmatic launch
    try:
        spt_no_pdl = seconds_per_token()
    finally:
        l3.comm.kernels.set_decode_pdl(True)
    fused_ops = net.ops
    net.ops = dataclasses.replace(fused_ops, decode=None)
    try:
        spt_unfused = seconds_per_token()
    finally:
        net.ops = fused_ops
    moved = L3B.weight_bytes_read(net) + L3B.kv_bytes_per_position(net) * (P + N / 2)
    return {"what": "1B decode bs1, triton backend, CUDA graph", "tokens_per_s": 1 / spt,
            "ms_per_token": spt * 1e3, "bytes_per_token": moved, "MBU": moved / spt / bw,
            "target_MBU": 0.8, "floor_ms": moved / bw * 1e3,
            "fused": fused_ops.decode is not None,
            "no_pdl_tokens_per_s": 1 / spt_no_pdl, "no_pdl_ms_per_token": spt_no_pdl * 1e3,
            "unfused_tokens_per_s": 1 / spt_unfused, "unfused_ms_per_token": spt_unfused * 1e3,
            "unfused_MBU": moved / spt_unfused / bw, "ratio": spt_unfused / spt,
            "ratio_reference": "the same run's unfused decode path (ops.decode off)"}


def prefill(net, _bw: float, peak: float, smoke: bool) -> dict:
    """The eager prefill (prefill_row: five runs after a same-shape warm-up, host enqueue vs
    one graph replay) and, on a GPU, the same prefill replayed from its bucket's CUDA graph
    (layer 3's CudaGraphPrefill), five runs after its capture."""
    tokens = 2048 if not smoke else 32
    loop_before = python_loop_ms()
    row = {**prefill_row(net, tokens, "triton", peak), "target_MFU": 0.6}
    # the host's interpreter speed around the eager runs: the eager figure follows it when
    # host_bound (the same machine's loop time has moved 2x within a minute)
    row["host_python_loop_ms"] = [loop_before, python_loop_ms()]
    _progress("eager", row, "MFU")
    if not smoke:
        row.update(bucket_graph_prefill(net, tokens, peak))
        _progress("bucket graph", row, "bucket_graph_MFU")
    row.update(engine_prefill(net, tokens, peak, smoke))
    _progress("engine", row, "engine_MFU")
    if not smoke:  # the engine's prefill steps replayed from its per-bucket graphs
        graphed = engine_prefill(net, tokens, peak, smoke, prefill_cuda_graph=True)
        row.update({f"graph_{k}": v for k, v in graphed.items()})
        row["graph_engine_ratio"] = row["engine_ms"] / graphed["engine_ms"]
        # the same prompts (one seed): the same greedy first tokens?
        row["graph_tokens_equal"] = graphed["engine_first_tokens"] == row["engine_first_tokens"]
        _progress("engine, prefill graphs", row, "graph_engine_MFU", "graph_tokens_equal",
                  "graph_engine_prefill_graph_pool_MiB", "graph_engine_graph_replays",
                  "graph_engine_host_before_replay_ms", "graph_engine_replay_gpu_ms",
                  "graph_engine_replay_gpu_MFU")
        row.update(first_decode(net, tokens))
        _progress("prefill + first decode", row, "first_decode_ms", "first_decode_saved_ms",
                  "first_decode_tokens_equal", "first_decode_early_launches",
                  "first_decode_asked")
    return row


def _progress(what: str, row: dict, *keys: str) -> None:
    """One line a finished sub-part (a run cut by its time limit keeps what it printed)."""
    print(json.dumps({"part": what, **{k: row.get(k) for k in keys}}, default=str), flush=True)


def first_decode(net, tokens: int, runs: int = 5) -> dict:
    """A lone prompt's prefill and its first decode through the engine (prefill graphs on):
    `LLM.generate` of a fresh `tokens`-token prompt, max_tokens 2, between device syncs, the
    first decode launched behind the still-running prefill (the engine's order) against the
    order before it (LaunchedStep.on_gpu answering False: the prefill's first token read,
    then the decode scheduled and launched while the GPU idles), alternating, `runs` each
    after one untimed of each (prefix caching off: the second run of a prompt computes it
    all again); whether both give the same two tokens, and how often the early launch was
    taken (on_gpu answering True)."""
    from layer4_algorithms import launched_step  # noqa: PLC0415

    sync = device_sync
    llm = LLM(l3.Model(net, None), max_num_seqs=1, max_num_batched_tokens=tokens,
              prefill_attention=net.prefill_attention,
              max_model_len=tokens + 16, num_blocks=-(-tokens // 16) * 2 + 8,
              cuda_graph=True, prefill_cuda_graph=True, enable_prefix_caching=False)
    params = l3.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    gen = torch.Generator().manual_seed(2)
    on_gpu = launched_step.LaunchedStep.on_gpu
    secs: dict[str, list[float]] = {"overlapped": [], "read_first": []}
    out_tokens: dict[str, list] = {"overlapped": [], "read_first": []}
    early: list[bool] = []

    def counted(self) -> bool:
        early.append(on_gpu(self))
        return early[-1]
    try:
        for i in range(1 + runs):
            prompt = torch.randint(0, net.config.vocab_size, (tokens,), generator=gen).tolist()
            for mode in secs:
                launched_step.LaunchedStep.on_gpu = (counted if mode == "overlapped"
                                                     else lambda self: False)
                sync()
                t0 = time.perf_counter()
                out = llm.generate([prompt], params)
                sync()
                if i:
                    secs[mode].append(time.perf_counter() - t0)
                out_tokens[mode].append(out[0].outputs[0].token_ids)
    finally:
        launched_step.LaunchedStep.on_gpu = on_gpu
    med = {m: statistics.median(v) * 1e3 for m, v in secs.items()}
    return {"first_decode_ms": med, "first_decode_runs_ms": {m: [x * 1e3 for x in v]
                                                             for m, v in secs.items()},
            "first_decode_saved_ms": med["read_first"] - med["overlapped"],
            "first_decode_tokens_equal": out_tokens["overlapped"] == out_tokens["read_first"],
            "first_decode_early_launches": sum(early), "first_decode_asked": len(early)}


def engine_prefill(net, tokens: int, peak: float, smoke: bool, runs: int = 5,
                   prefill_cuda_graph: bool = False) -> dict:
    """The same prefill through layer 4's engine (its own path: schedule, the paged cache's
    context, the forward, sampling the first token and reading it back): `LLM.generate` of
    one fresh random `tokens`-token prompt, max_tokens 1, two untimed then `runs` timed (a
    new prompt each: no prefix-cache hit), each between device syncs; the engine's config as
    in the engine part (CUDA graphs, async scheduling), its token budget the prompt.
    prefill_cuda_graph: the engine's prefill steps from its per-bucket graphs (the prompt
    fills the largest bucket: no padding), their pool's size reported."""
    dev = net.device
    sync = device_sync if dev.type == "cuda" else (lambda: None)
    llm = LLM(l3.Model(net, None), max_num_seqs=1, max_num_batched_tokens=tokens,
              prefill_attention=net.prefill_attention,
              max_model_len=tokens + 16, num_blocks=-(-tokens // 16) * 2 + 8,
              cuda_graph=not smoke, prefill_cuda_graph=prefill_cuda_graph)
    params = l3.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    secs, steps, first = [], [], []
    graphs = getattr(llm.runner, "prefill_graph", None)
    marks: list[tuple] = []  # per replay: host clock at entry, after, CUDA events around it
    if graphs is not None:
        run = graphs.run

        def timed_run(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t_in = time.perf_counter()
            start.record()
            got = run(*a, **k)
            end.record()
            marks.append((t_in, time.perf_counter(), start, end, got is not None))
            return got
        graphs.run = timed_run
    before, gpu, replays, out = [], [], 0, None
    for i in range(2 + runs):
        prompt = torch.randint(0, net.config.vocab_size, (tokens,), generator=gen).tolist()
        # the last call's result let go before the clock starts, not by `out = ` inside it: its
        # prompt's 2k ints are freed there (~40 us on the dev VM, ~60 on an H100 box)
        out = None
        sync()
        marks.clear()
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)
        sync()
        if i >= 2:
            secs.append(time.perf_counter() - t0)
            steps.append(llm.stats.steps)
            replays += sum(m[4] for m in marks)
            if marks:  # host time before the replay; the replay's GPU time (input copies too)
                before.append((marks[0][0] - t0) * 1e3)
                gpu.append(marks[0][2].elapsed_time(marks[0][3]))
        if len(out[0].outputs[0].token_ids) != 1:
            raise RuntimeError("the engine's prefill did not sample one token")
        first.append(out[0].outputs[0].token_ids[0])
    med, flops = statistics.median(secs), L3B.prefill_flops(net, tokens)
    pool = getattr(graphs, "pool_bytes", 0)
    extra = {} if graphs is None else {
        "engine_graph_replays": replays, "engine_host_before_replay_ms": before,
        "engine_replay_gpu_ms": gpu,
        "engine_replay_gpu_MFU": L3B.prefill_flops(net, tokens) / (
            statistics.median(gpu) / 1e3) / peak if gpu else None}
    return {**extra, "engine_first_tokens": first,
            "engine_prefill_graph_pool_MiB": pool / 2**20,
            "engine_ms": med * 1e3, "engine_runs_ms": [s * 1e3 for s in secs],
            "engine_MFU": flops / med / peak, "engine_MFU_min": flops / max(secs) / peak,
            "engine_MFU_max": flops / min(secs) / peak, "engine_steps": steps,
            "engine_target_MFU": 0.7}


def bucket_graph_prefill(net, tokens: int, peak: float, runs: int = 5) -> dict:
    """Batch-1 prefill through CudaGraphPrefill (bucket = tokens: no padding): the capture
    and two untimed replays first, then `runs` medians of 10 replays, and the host's time to
    issue one (input copies + replay + logits copy)."""
    cache = l3.ContiguousKVCache.for_model(net.config, 1, tokens, dtype=net.dtype,
                                           device=net.device)
    graphs = CudaGraphPrefill(net, cache, buckets=(tokens,))
    ids = torch.randint(0, net.config.vocab_size, (tokens,), device=net.device)
    for _ in range(3):
        graphs.prefill(ids)
    secs = [l3.comm.kernels.hardware.time_fn(lambda: graphs.prefill(ids), warmup=2, repeats=10,
                                             device=net.device).median_s for _ in range(runs)]
    enqueue = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs.prefill(ids)
        enqueue.append(time.perf_counter() - t0)
    flops, med = L3B.prefill_flops(net, tokens), statistics.median(secs)
    # the graph's logits against the eager forward's, and the eager forward with RoPE and
    # the cache write unfused (as before today) against the fused one: same numbers?
    eager_cache = l3.ContiguousKVCache.for_model(net.config, 1, tokens, dtype=net.dtype,
                                                 device=net.device)
    ctx = eager_cache.context([tokens], [0])
    eager = net(ids, ctx, eager_cache, last_only=True)[0]
    fused_ops = net.ops
    net.ops = dataclasses.replace(fused_ops, rope_write=None)
    try:
        unfused = net(ids, ctx, eager_cache, last_only=True)[0]
    finally:
        net.ops = fused_ops
    graphed = graphs.prefill(ids)

    def same(a, b) -> dict:
        return {"equal": bool(torch.equal(a, b)), "argmax_equal": bool(a.argmax() == b.argmax()),
                "rel_diff": float((a - b).norm() / b.norm())}
    return {"bucket_graph_vs_eager": same(graphed, eager),
            "eager_fused_vs_unfused_rope_write": same(eager, unfused),
            "bucket_graph_ms": med * 1e3, "bucket_graph_runs_ms": [s * 1e3 for s in secs],
            "bucket_graph_MFU": flops / med / peak,
            "bucket_graph_MFU_min": flops / max(secs) / peak,
            "bucket_graph_MFU_max": flops / min(secs) / peak,
            "bucket_graph_host_enqueue_ms": statistics.median(enqueue) * 1e3}


def engine(net, bw: float, peak: float, smoke: bool) -> dict:
    """The workload with async scheduling on (the CUDA default) twice, then off once, in one
    engine (the flag is read every step; generate leaves no step in flight): the headline is
    the async runs' median, the synchronous run is the before/after reference."""
    seqs, lo, hi = (256, 100, 1024) if not smoke else (6, 4, 16)
    wl = L4B.random_workload(seqs, lo, hi, net.config.vocab_size)
    kw = dict(block_size=16, max_num_batched_tokens=8192, cuda_graph=not smoke,
              max_model_len=2 * hi + 64, num_blocks=None if not smoke else 512)
    llm = LLM(l3.Model(net, None), max_num_seqs=seqs, async_scheduling=True,
              prefill_attention=net.prefill_attention, **kw)
    runs = {True: [], False: []}
    for mode in (True, True, False):
        llm.config.async_scheduling = mode
        runs[mode].append(L4B.time_engine(llm, wl))  # each after its own warm-up
    floor = L4B.roofline_floor_s(net, wl, seqs, bw, peak)

    def summary(rs: list[dict]) -> dict:
        return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "runs_tokens_per_s": [r["tokens_per_s"] for r in rs], "steps": rs[-1]["steps"],
                "roofline_fraction": floor / statistics.median(r["seconds"] for r in rs)}

    on, off = summary(runs[True]), summary(runs[False])
    return {"what": f"engine, nano-vllm workload, {seqs} seqs, continuous batching, "
                    "async scheduling",
            **on, "sync": off, "async_speedup": on["tokens_per_s"] / off["tokens_per_s"],
            "roofline_floor_s": floor, "target_roofline_fraction": 0.5,
            "output_tokens": wl.output_tokens}


PARTS = {"decode": decode, "prefill": prefill, "engine": engine}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--gemv-tuned", type=Path, default=None,
                    help="decode_kernels.json from benchmarks/decode_kernels_bench.py: use its "
                         "best GEMV tiles per shape")
    ap.add_argument("--fused-only", action="store_true",
                    help="decode: time only the fused path (no PDL-off / unfused comparison)")
    ap.add_argument("--prefill-attention", choices=l3.PREFILL_ATTENTION, default="flash",
                    help="a lone prompt's attention (the model's and every engine's): layer "
                         "1's flash kernel or cuDNN's (EngineConfig.prefill_attention)")
    args = ap.parse_args(argv)
    if args.gemv_tuned is not None:
        best = json.loads(args.gemv_tuned.read_text())["best"]
        l3.comm.kernels.GEMV_TUNED.update(
            {tuple(int(d) for d in k.split("x")): tuple(v) for k, v in best.items()})
    net, bw, peak = _setup(args.smoke)
    if args.prefill_attention != "flash":
        net.set_backend(net.backend, prefill_attention=args.prefill_attention)
    with torch.no_grad():
        if args.part == "decode":
            result = decode(net, bw, peak, args.smoke, args.fused_only)
        else:
            result = PARTS[args.part](net, bw, peak, args.smoke)
    result.update(device=torch.cuda.get_device_name() if not args.smoke else "cpu (smoke)",
                  copy_bandwidth=bw, bf16_flops=peak, torch=torch.__version__,
                  prefill_attention=net.prefill_attention,
                  flash_heads_first=importlib.import_module(
                      "layer1_kernels.flash_attention").CAUSAL_HEADS_FIRST)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.part}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list | dict)},
                     default=str))
    return result


if __name__ == "__main__":
    main()
