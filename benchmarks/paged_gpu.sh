#!/usr/bin/env bash
# The paged decode kernel on one GPU (H100 or H200) in ONE bounded device call (<= 200 s):
#   bash benchmarks/paged_gpu.sh      (results under $OUT; a short table last)
# Steps, each with its own time limit (log: $OUT/NAME.log, JSON beside); a step starts only if
# its limit fits in what is left of TOTAL_S (default 200):
#   kernel    `stack bench --layer 4 --only kernel`: the 12 shapes (batch 1/4/8/32 x 1k/4k/16k)
#             against SDPA, do_bench and CUDA-graph replay, with the defaults now
#   defaults  the same 12 shapes, layer 4's wrapper before (the previous split rule and merge
#             tile) and after, with layer 1's PIPELINED_IDS knob flipped, and SDPA, in one
#             process (sweep_paged.py --defaults --flip-pipelined)
#   sweep     the shapes below 0.9x and the engine-like batch 256: heads-first configs (merge
#             tile 8/16/32 parts, 1-3 stages, 64 or 128 keys a step; 2, 4 or 8 kv heads
#             packed in a program) x split counts 1-64 (sweep_paged.py)
#   tests     pytest -m gpu of layer 1's paged kernel and layer 4's paged attention (the time
#             left, at most 90 s)
#   d128      Llama-3.1-8B heads (32/8, D 128) at batch 32 x 1k/4k: one part vs two
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/results LLM_STACK_CACHE=/tmp/llm-stack-cache
export TOTAL_S=${TOTAL_S:-200}
logs=$out; . "$(dirname "$0")/device_steps.sh"
install_stack
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  git log --oneline -1 2>/dev/null; date -u; } 2>&1 | tee "$out/env.txt"

maybe kernel 40 stack bench --layer 4 --only kernel
maybe defaults 40 python3 benchmarks/sweep_paged.py --out "$out" --flip-pipelined --defaults \
    1:1024,1:4096,1:16384,4:1024,4:4096,4:16384,8:1024,8:4096,8:16384,32:1024,32:4096,32:16384
# configs: 11 = the D-64 default (128 keys, 4 warps, 2 stages, heads first; merge 16 parts),
# 10 = 64 keys a step (96 registers: 5 programs an SM), 13/14 = 11 with 32/8 merge parts,
# 15/16 = 1/3 stages, 17 = 64 keys unpipelined,
# 19-22 = kv heads packed: 4 x 32 keys, 2 x 64, 4 x 32 in 3 stages, 8 x 16
maybe sweep 50 python3 benchmarks/sweep_paged.py --out "$out" --budget-s 34 \
    --shapes 1:16384,32:1024,32:4096,4:4096,256:engine,32:16384 \
    --configs 10,11,13,14,15,16,17,19,20,21,22 \
    --splits 1,2,4,8,16,32,64
left=$(( TOTAL_S - SECONDS - 2 ))  # the tests get what is left (23 tests, ~25 compiles)
if [ "$left" -ge 20 ]; then
    maybe tests $(( left > 90 ? 90 : left )) python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/layer1/test_paged_decode.py tests/layer4/test_paged_attention.py
else echo "== tests: SKIPPED ($left s left)"; fi
tail -2 "$out/tests.log" 2>/dev/null
mkdir -p "$out/d128"
maybe d128 15 python3 benchmarks/sweep_paged.py --out "$out/d128" --budget-s 8 \
    --heads 32:8:128 --shapes 32:1024,32:4096 --configs 18 --splits 1,2

{ echo "== summary ($(date -u), $SECONDS s; JSON and logs under \$OUT) =="
  cat "$out/env.txt"
  tail -1 "$out/tests.log" 2>/dev/null
  grep -v "Warning\|sdpa(q" "$out/kernel.log" 2>/dev/null | grep -E "^ +[0-9]+ +[0-9]+ " | head -12
  grep -A13 "^batch context | splits" "$out/defaults.log" 2>/dev/null
  grep -A13 "^batch context | PIPELINED_IDS" "$out/defaults.log" 2>/dev/null
  grep -A7 "^batch context | best" "$out/sweep.log" 2>/dev/null
  grep -A3 "^batch context | best" "$out/d128.log" 2>/dev/null; } | tee "$out/summary.txt"
