"""`stack run --layer 4`: the engine serves the course model on the CPU. Requests arrive over
time (some share a scene's opening, lengths differ, one samples n=2), continuous batching with
chunked prefill and the prefix cache; prints each completion with its timings and the
engine's statistics."""
from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

import layer3_model as l3

from ..engine import LLM

console = Console()
if not console.is_terminal:  # piped or captured: wide tables instead of wrapped cells
    console = Console(width=160)


def _ms(s: float | None) -> str:
    return "" if s is None else f"{s * 1e3:,.1f}"


SCENE = ("HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to "
         "suffer\n"
         "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of "
         "troubles\n\n")
REQUESTS = [  # (prompt, max_tokens, n): the first four share the scene's opening
    (SCENE + "OPHELIA.\n", 60, 1), (SCENE + "HORATIO.\n", 40, 2), (SCENE + "KING.\n", 80, 1),
    (SCENE + "QUEEN.\n", 30, 1),
    ("ROMEO.\nBut soft, what light through yonder window breaks?\n\nJULIET.\n", 70, 1),
    ("MACBETH.\n", 50, 1), ("PORTIA.\nThe quality of mercy is not strained.\n\nSHYLOCK.\n", 45, 1),
]


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="stack run --layer 4",
                                 description="the engine serves the course model")
    ap.add_argument("--model", default=None,
                    help="HF checkpoint dir (default: the course target model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="default: from the device's memory budget")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64,
                    help="step budget (small: chunked prefill shows)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", choices=("none", "ngram", "draft"), default="none")
    args = ap.parse_args(argv)
    spec = None if args.speculative == "none" else dict(method=args.speculative, k=4)
    llm = LLM(args.model or l3.course_model_dir("target"), device=args.device, dtype="float32",
              block_size=args.block_size, num_blocks=args.num_blocks,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, speculative=spec)
    console.print(f"[dim]{args.model or 'course target model'} on {args.device}: "
                  f"{llm.block_manager.num_blocks} KV "
                  f"blocks of {args.block_size} tokens, max {args.max_num_seqs} sequences and "
                  f"{args.max_num_batched_tokens} tokens per step; two requests arrive per step[/]")
    pending, outs = list(enumerate(REQUESTS)), {}
    while pending or llm.has_unfinished():
        for _ in range(2):  # arrivals while others run: continuous batching admits them mid-flight
            if pending:
                i, (prompt, max_tokens, n) = pending.pop(0)
                params = l3.SamplingParams(temperature=args.temperature, top_k=40,
                                           seed=args.seed + 10 * i, max_tokens=max_tokens,
                                           stop=("\n\n",), n=n)
                llm.add_request(prompt, params, str(i))
        for o in llm.step(unfinished=False):
            outs[o.request_id] = o
    table = Table(title="completions (stop at a blank line)", show_lines=True)
    for col in ("#", "cue", "completion", "finish", "cached", "queue ms", "TTFT ms", "TPOT ms"):
        table.add_column(col)
    for rid in sorted(outs, key=int):
        o, m = outs[rid], outs[rid].metrics
        cue = o.prompt.strip().splitlines()[-1]
        for c in o.outputs:
            which = f" ({c.index + 1}/{len(o.outputs)})" if len(o.outputs) > 1 else ""
            table.add_row(rid + which, cue,
                          " ".join(c.text.split())[:100], c.finish_reason,
                          f"{m.num_cached_tokens}/{m.num_prompt_tokens}", _ms(m.queue_time),
                          _ms(m.ttft), _ms(m.tpot))
    console.print(table)
    st = llm.stats
    acc = "n/a (speculative decoding off: --speculative)"
    if st.acceptance_rate is not None:
        acc = f"{st.acceptance_rate:.0%}"
    console.print(f"[bold]{st.generated_tokens} tokens generated in {st.elapsed_s:.2f} s[/] over "
                  f"{st.steps} steps: "
                  f"{st.generated_tokens_per_s:,.0f} tokens/s out, {st.total_tokens_per_s:,.0f} "
                  "tokens/s in+out\n"
                  f"prefix cache: {st.prefix_hit_tokens} of {st.prefix_queried_tokens} prompt "
                  "tokens hit "
                  f"({st.prefix_hit_rate:.0%}); preemptions: {st.preemptions}; speculative "
                  f"acceptance: {acc}")
    return 0
