#!/usr/bin/env bash
# h-arll (branch h-arll): the batch-1 TP all-reduce sent from the row-parallel GEMV's epilogue
# (LLM_STACK_TP_GEMV_SEND, off by default). 2 GPUs (nvidia-h100-x2), < 300 s incl. install.
# Run from the root of a checkout of branch h-arll:  bash /work/wt/gpu_requests/h-arll.sh
# (carry .whl if the tree has it: layer 4 imports llguidance). Outputs: $OUT/h-arll.tgz
# (every log and JSON) and $OUT/summary.txt. Steps that do not fit TOTAL_S (290 s) are skipped
# and say so: TOTAL_S=560 runs all in one call (10-minute limit), or ONLY="bench_off bench_on".
set -uo pipefail
top=${OUT:-gpu-out}; out=$top/h-arll; mkdir -p "$out"
export TOTAL_S=${TOTAL_S:-290} STEP_TAIL=12
logs=$out; . benchmarks/device_steps.sh
gpu_session "multigpu"
# 1. correctness: gemv_all_reduce == gemv + all-reduce bit for bit (bf16/fp16, odd N, both
#    prologues, between the other peer kernels, 100 graph replays, PDL on/off); the TP=2 engine's
#    greedy tokens with the switch on == off (CUDA graphs)
maybe tests 110 bash -c "$T tests/layer2/test_gemv_send_gpu.py tests/layer5/test_tp_gemv_send_gpu.py"
verdicts tests 8
# 2. one TP=2 decoder layer's chain at batch 1: us/layer with no all-reduce, the LL+PDL
#    one-shot, and ll+send (o_proj and down through gemv_all_reduce)
maybe chain 50 python3 benchmarks/tp_decode_chain.py --rows 1 --variants none,ll+pdl,ll+send \
    --json "$out/chain.json"
grep -s "tp-chain\]" "$out/chain.log"
# 3. the engine at TP=2 (8B shape, ours), batch 1 and 32: switch off, then on
maybe bench_off 85 env LLM_STACK_TP_GEMV_SEND=0 python3 -m layer5_parallel.bench.tp_gpu_bench \
    --shapes llama-3.1-8b --tps 2 --tp-backends ours --repeats 2 --no-phases \
    --phase-timeout 75 --out "$out/off"
maybe bench_on 85 env LLM_STACK_TP_GEMV_SEND=1 python3 -m layer5_parallel.bench.tp_gpu_bench \
    --shapes llama-3.1-8b --tps 2 --tp-backends ours --repeats 2 --no-phases \
    --phase-timeout 75 --out "$out/on"
for s in bench_off bench_on; do echo "== $s"; grep -s "tok/s" "$out/$s.log" | cut -c1-160; done
{ verdicts tests 8; grep -s "tp-chain\]" "$out/chain.log"
  for s in bench_off bench_on; do echo "== $s"; grep -s "tok/s" "$out/$s.log" | cut -c1-160; done
} > "$top/summary.txt"
tar czf "$top/h-arll.tgz" -C "$top" h-arll && rm -rf "$out"
echo "== done in $SECONDS s"
