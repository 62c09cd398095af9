"""Pipeline-parallel decode on GPUs: where a step's time goes (one command, 2 GPUs).

One decode-heavy workload (N sequences, short prompts, greedy, ignore_eos) through
    PP=1 on one GPU, with and without CUDA graphs (pipelines run without them)
    PP=2 with 1, 2 and 4 micro-batches, under two ways of waiting for a stage hand-off:
      PP_WAIT=timeout  patched in here: work.wait(timeout), the engine's wait before its GPU
                       hand-offs became stream-ordered. On NCCL a timeout makes the *host*
                       wait until the transfer has finished (torch's WorkNCCL::wait polls
                       isCompleted with ~1 ms sleeps), so a stage's host cannot queue
                       micro-batch i's kernels before micro-batch i has arrived.
      PP_WAIT=stream   the engine as it is (stage._wait on CUDA): work.wait() without a
                       timeout, i.e. the compute stream waits for the transfer and the host
                       queues on.
Each configuration runs in a process of its own (`--one`), killed past its time limit (its
workers die with it). The patch sits at module level, so the pipeline's worker processes
(spawned: they import this file again as __mp_main__) get it too.

Per run: tokens/s, ms per engine step, each rank's seconds inside its stage's forward calls
(host time: on GPUs the time to queue the kernels, plus any host sync inside) against the
pipelined forwards' wall seconds, and whether the tokens equal PP=1's (no graphs).

    python3 benchmarks/pp_gpu_probe.py --out $OUT            # GPUs: 1B shape, random bf16
    python3 benchmarks/pp_gpu_probe.py --out /tmp/p --quick  # a CPU dry run (course model)

Results: $OUT/pp_gpu_probe.json and one line per run on stdout (flushed as it goes).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if os.environ.get("PP_WAIT", "timeout") == "timeout":  # see the docstring: every process
    from datetime import timedelta

    from layer5_parallel.pipeline_parallel import stage as _stage

    def _host_wait(work, what: str, timeout_s: float, device=None) -> None:
        work.wait(timeout=timedelta(seconds=timeout_s))

    _stage._wait = _host_wait


def _model(device: str):
    """(layer 3's API, the model): the Llama-3.2-1B shape with random bf16 weights on GPUs,
    the course model on a CPU."""
    import torch

    import layer4_algorithms as engine

    l3 = engine.executor
    if device == "cuda":
        config = l3.ModelConfig.from_dict(l3.LLAMA_3_2_1B)
        return l3, l3.Model(l3.random_model(config, dtype=torch.bfloat16, device="cuda:0"))
    return l3, l3.load(l3.course_model_dir("target"), dtype="float32", device="cpu")


def one(args) -> dict:
    """One configuration in this process -> its row."""
    import torch

    from layer5_parallel import LLM

    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    if device == "cpu":  # as each pipeline rank does on this host's cores (and no oversubscription)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    l3, model = _model(device)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    lo, hi = args.prompt_min or args.prompt_len, args.prompt_len
    lens = torch.randint(lo, hi + 1, (args.seqs,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    kw = dict(max_num_seqs=args.seqs, cuda_graph=bool(args.graph) and device == "cuda",
              tp_timeout_s=args.timeout_s)
    if device == "cuda":  # graphs and block tables sized for this workload, not 128k tokens
        kw["max_model_len"] = hi + args.max_tokens + 16
    if args.pp > 1:
        kw.update(pipeline_parallel_size=args.pp, pp_micro_batches=args.micro)
    start = time.perf_counter()
    llm = LLM(model, **kw)
    ready = time.perf_counter() - start
    try:
        warm = l3.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts[:4], warm)
        if args.pp > 1:
            llm.model.net.stage_busy()  # reset the counters
        params = l3.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        steps = llm.stats.steps
        tokens = [o.outputs[0].token_ids for o in outs]
        name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
        row = {"pp": args.pp, "micro": args.micro, "graph": kw["cuda_graph"],
               "wait": os.environ.get("PP_WAIT", "timeout") if args.pp > 1 else "-",
               "seqs": args.seqs, "prompts": [lo, hi], "device": name,
               "seconds": wall, "steps": steps, "ms_per_step": 1e3 * wall / steps,
               "tok_s": sum(map(len, tokens)) / wall, "startup_s": ready, "tokens": tokens}
        if args.pp > 1:
            ranks = llm.model.net.stage_busy()
            row["ranks"] = [{"rank": r["rank"], "busy_s": r["busy_s"], "wall_s": r["wall_s"],
                             "forwards": r["forwards"]} for r in ranks]
            row["control_s"] = llm.tp_group.control_s
            row["last_forwards"] = _last_forwards(ranks, args.timeline)
        return row
    finally:
        llm.close()


def _last_forwards(ranks: list[dict], png: str | None, n: int = 3) -> dict:
    """The last n pipelined forwards: rank 0's spans and every rank's ("F", micro-batch,
    start, end) host intervals, in ms from the first span's start (perf_counter is one clock
    for every process here); drawn to `png` if given (one lane per rank)."""
    spans = ranks[0]["spans"][-n:]
    if not spans:
        return {}
    t0 = spans[0][0]
    lanes = [[e for e in r["events"] if e[2] >= t0] for r in ranks]
    if png:
        from layer5_parallel.bench.timeline import plot_timeline

        plot_timeline(lanes, png, f"last {len(spans)} pipelined forwards (host intervals)")
    ms = lambda t: round(1e3 * (t - t0), 3)  # noqa: E731
    return {"spans_ms": [[ms(a), ms(b)] for a, b in spans],
            "events_ms": [[[e[1], ms(e[2]), ms(e[3])] for e in lane] for lane in lanes]}


def driver(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seqs = [8] if args.quick else [int(s) for s in args.seqs_list.split(",")]
    tokens = 8 if args.quick else args.max_tokens
    prompt_len = 32 if args.quick else args.prompt_len
    plan = []  # (sequences, prompt lengths, pp, micro-batches, graph, wait)
    uniform = (prompt_len, prompt_len)
    for n in seqs:
        plan += [(n, uniform, 1, 1, 1, "timeout"), (n, uniform, 1, 1, 0, "timeout")]
        if n == seqs[0]:  # mixed steps (prefill chunks beside decodes), as the nano-vllm load:
            mixed = (prompt_len // 4, 8 * prompt_len)  # big streams and big logits cross
            plan += [(n, mixed, 1, 1, 0, "timeout"), (n, mixed, 2, 2, 0, "timeout"),
                     (n, mixed, 2, 2, 0, "stream")]
        for wait in ("timeout", "stream"):
            plan += [(n, uniform, 2, m, 0, wait) for m in (1, 2, 4)]
    import torch

    from layer5_parallel.bench.dp import wait_for_free_gpus

    gpus = torch.cuda.device_count()
    rows, deadline = [], time.monotonic() + args.total_s
    for n, (lo, hi), pp, micro, graph, wait in plan:
        left = deadline - time.monotonic()
        name = f"N={n} prompts {lo}..{hi} PP={pp} m={micro} graph={graph} wait={wait}"
        if left < 30:
            print(f"  skipped (out of time): {name}", flush=True)
            continue
        cmd = [sys.executable, __file__, "--one", "--pp", str(pp), "--micro", str(micro),
               "--graph", str(graph), "--seqs", str(n), "--max-tokens", str(tokens),
               "--prompt-len", str(hi), "--prompt-min", str(lo),
               "--timeout-s", str(args.timeout_s)]
        if pp > 1:
            cmd += ["--timeline", str(out / f"timeline_n{n}_{lo}-{hi}_m{micro}_{wait}.png")]
        env = dict(os.environ, PP_WAIT=wait)
        if gpus >= 2:  # the last run's processes may still be freeing their memory
            wait_for_free_gpus(gpus)
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=min(args.run_s, left))
        except subprocess.TimeoutExpired:
            print(f"  {name}: did not finish within {min(args.run_s, left):.0f} s", flush=True)
            rows.append({"name": name, "timed_out": True})
            continue
        lines = [x for x in done.stdout.splitlines() if x.startswith("ROW ")]
        if done.returncode or not lines:
            print(f"  {name}: failed (rc {done.returncode}): {done.stderr[-800:]}", flush=True)
            rows.append({"name": name, "failed": done.stderr[-2000:]})
            continue
        row = json.loads(lines[-1][4:])
        row["name"] = name
        rows.append(row)
        busy = " ".join(f"r{r['rank']} {r['busy_s'] / r['wall_s']:.0%}"
                        for r in row.get("ranks", []))
        print(f"  {name}: {row['tok_s']:,.0f} tok/s, {row['ms_per_step']:.2f} ms/step "
              f"({row['steps']} steps, {row['seconds']:.1f} s; started in {row['startup_s']:.0f} s)"
              + (f"; busy/wall {busy}" if busy else ""), flush=True)
    for r in rows:  # tokens equal to PP=1 without graphs (same numerics as the pipeline)
        ref = next((x for x in rows if x.get("seqs") == r.get("seqs") and x.get("pp") == 1
                    and x.get("prompts") == r.get("prompts") and not x.get("graph")), None)
        if "tokens" in r and ref is not None:
            r["same_tokens_as_pp1_nograph"] = r["tokens"] == ref["tokens"]
    for r in rows:
        r.pop("tokens", None)
    (out / "pp_gpu_probe.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'pp_gpu_probe.json'}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/pp_gpu_probe"))
    ap.add_argument("--quick", action="store_true", help="a short CPU dry run")
    ap.add_argument("--seqs-list", default="64,256")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128, help="(longest) prompt length")
    ap.add_argument("--prompt-min", type=int, default=0, help="shortest (0: --prompt-len)")
    ap.add_argument("--timeout-s", type=float, default=30.0,
                    help="the engine's tp_timeout_s: a hung hand-off fails after this")
    ap.add_argument("--run-s", type=float, default=90.0, help="limit per configuration")
    ap.add_argument("--total-s", type=float, default=540.0, help="limit for the whole run")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--graph", type=int, default=0)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--timeline", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("ROW " + json.dumps(one(args)), flush=True)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
