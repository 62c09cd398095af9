#!/usr/bin/env bash
# The batch-1 tensor-parallel all-reduce sent from the row-parallel GEMV's epilogue (layer 2's
# gemv_send.py; on by default, LLM_STACK_TP_GEMV_SEND=0 turns it off), on 2 GPUs in ONE device
# call (< ~300 s with the install):   bash benchmarks/gemv_send_gpu.sh   (carry .whl)
# Steps (each with its own limit, skipped with a line if it does not fit TOTAL_S; ONLY picks):
#   tests  gemv_all_reduce == layer 1's GEMV then the all-reduce, bit for bit (bf16/fp16, odd N,
#          both prologues, between the other peer kernels, PDL on/off, 100 graph replays); the
#          TP=2 engine's greedy tokens with the send on == off
#   chain  one TP=2 decoder layer at batch 1, us a layer: no all-reduce, the LL one-shot + PDL,
#          the send + the receive kernel (what each all-reduce costs over none)
#   bench  the 8B shape's TP=2 engine (ours), batch 1 and 32, send on (default) and off, one process
# What to read: tests PASSED; chain "ll+send ... same as ll+pdl: bits" and its us an all-reduce
# against ll+pdl's; bench batch-1 tok/s on vs off (batch 32 does not take this path).
set -uo pipefail
top=${OUT:-gpu-out}; out=$top/gemv_send; mkdir -p "$out"
export TOTAL_S=${TOTAL_S:-290} STEP_TAIL=12
logs=$out; . "$(dirname "$0")/device_steps.sh"
gpu_session "multigpu"
maybe tests 110 bash -c "$T tests/layer2/test_gemv_send_gpu.py tests/layer5/test_tp_gemv_send_gpu.py"
verdicts tests 8
maybe chain 50 python3 benchmarks/tp_decode_chain.py --rows 1 --variants none,ll+pdl,ll+send \
    --json "$out/chain.json"
grep -s "tp-chain\]" "$out/chain.log"
maybe bench 120 python3 -m layer5_parallel.bench.tp_gpu_bench --shapes llama-3.1-8b --tps 2 \
    --tp-backends ours --repeats 1 --no-phases --phase-timeout 75 \
    --switches default,pdl+ll+norms --out "$out/bench"
grep -s "tok/s" "$out/bench.log" | cut -c1-160
{ verdicts tests 8; grep -s "tp-chain\]" "$out/chain.log"; grep -s "tok/s" "$out/bench.log" | cut -c1-160
} > "$top/summary.txt"
tar czf "$top/gemv_send.tgz" -C "$top" gemv_send && rm -rf "$out"
echo "== done in $SECONDS s"
