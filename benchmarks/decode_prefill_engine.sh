#!/usr/bin/env bash
# Decode, prefill and the engine measured in ONE device-machine call on an H100, under 9 minutes:
#   bash benchmarks/decode_prefill_engine.sh
# Steps (each with its own time limit, log in $OUT/NAME.log, JSON beside it):
#   decode   1B shape, batch 1, triton backend, CUDA graph: tok/s and MBU       (decode_prefill_engine.py)
#   prefill  2048 tokens x5 after a same-shape warm-up: median and min-max MFU  (decode_prefill_engine.py)
#   engine   nano-vllm workload, 256 seqs, timed twice after warm-up: tok/s, of roofline floor
#   profile  per decode step: wall vs GPU busy (GPU-idle fraction), CUDA-graph coverage
#   kernel   paged decode vs SDPA: do_bench and under CUDA-graph replay        (stack bench)
#   spec     speculative decoding on the GPU, draft and n-gram, greedy-identical (stack bench)
# then a compact summary table (decode_prefill_engine_summary.py): the reply shows only the output's tail.
#   pytest   the new GPU tests (draft CUDA graph) and the engine's graph runner
# Worst case (every step at its limit): ~520 s (~45 s of setup included); typical well under that.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/results LLM_STACK_CACHE=/tmp/llm-stack-cache
logs=$out; . "$(dirname "$0")/device_steps.sh"
install_stack
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
triton.__version__, "transformers", transformers.__version__)'; } 2>&1 | tee "$out/env.txt"
timeout 40 python3 -c 'import layer3_model as l3; c = l3.load_ceilings("cuda"); bf = c.flops["bf16"]
print(f"ceilings: {c.memory_bandwidth / 1e12:.2f} TB/s copy, bf16 {bf / 1e12:.0f} TFLOP/s")' 2>&1 \
    | tail -1 | tee -a "$out/env.txt"

step decode 50 python3 benchmarks/decode_prefill_engine.py decode --out "$out"
step prefill 60 python3 benchmarks/decode_prefill_engine.py prefill --out "$out"
step engine 90 python3 benchmarks/decode_prefill_engine.py engine --out "$out"
step profile_engine 90 python3 benchmarks/profile_engine.py --seqs 256 --steps 10 \
    --profile-steps 8 --json "$out/profile_engine.json"
grep -A12 "^ step batch" "$out/profile_engine.log"
step kernel 60 stack bench --layer 4 --only kernel
grep -v "Warning\|sdpa(q" "$out/kernel.log" | grep -E "^ +[0-9]+ +[0-9]+ " | head -16
# spec: the configurations that matter on the GPU. The full default set (13 configurations x 4
# prompts, ~110 generate calls) takes 60 s or more on a warm machine, too close to the 80 s
# limit; this set prints a progress line per row and takes ~30 s.
step spec 80 stack bench --layer 4 --only spec --spec-devices cuda --spec-repeats 1 \
    --spec-ks 3,6 --spec-dynamic '' --spec-ngram-ks 4,6 --spec-hybrid-ks 6
grep -A8 "geometric-mean\|DIFFER" "$out/spec.log"
step pytest_gpu 45 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/layer4/test_speculative_graph.py tests/layer4/test_cuda_graph_runner.py
tail -3 "$out/pytest_gpu.log"
echo "== summary (decode MBU, prefill MFU, engine tok/s; JSON and logs under \$OUT) =="
cat "$out/env.txt"
python3 benchmarks/decode_prefill_engine_summary.py "$out"
