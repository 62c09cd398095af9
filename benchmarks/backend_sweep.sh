#!/usr/bin/env bash
# Triton backend vs torch backend on one GPU, with the paged kernel and the decode/prefill/engine
# rows, in ONE device-machine call (one H100 or H200; typical ~470 s, never past ~570 s):
#   bash benchmarks/backend_sweep.sh          (results under $OUT; a short table last)
# Steps, in order of importance, each with its own time limit (log: $OUT/NAME.log, JSON beside):
#   pytest_gpu  the -m gpu tests of the kernels and paths this round touches (and of the shared
#               capture helper / gemv prologue fold: prefill graph, speculative graph; the
#               varlen prefill attention against the per-sequence kernel and the torch backend)
#   sweep_8b    Llama-3.1-8B shape: decode tok/s, torch vs triton backend, batch 1/8/32/128/256,
#               graph-replayed step and LLM.generate; fused vs general at batch 1/2/4/8;
#               top kernels of a batch-32 step per backend            (backend_sweep.py)
#   sweep_1b    the same on the Llama-3.2-1B shape
#   kernel      paged decode vs SDPA at the 12 shapes, do_bench and graph replay (stack bench)
#   decode      1B batch 1, triton backend, CUDA graph: tok/s, MBU  (decode_prefill_engine.py)
#   engine      nano-vllm workload, 256 seqs: tok/s, of roofline floor
#   prefill     2048 tokens: MFU, eager and bucket graph
#   paged32     the paged kernel's configs x split counts at batch 32 x 1k/4k/16k (sweep_paged.py)
# A step starts only if its limit fits in what is left of TOTAL_S (default 560 s), so the call
# ends inside the device's 600 s; skipped steps are named. ONLY="sweep_8b kernel": just those.
# SWEEP_ARGS: more backend_sweep.py options for both sweeps, one word each (e.g.
# "--general-batches=1 --extra= --profile-batch=0": the backend and engine rows, quicker).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/results LLM_STACK_CACHE=/tmp/llm-stack-cache
logs=$out; . "$(dirname "$0")/device_steps.sh"
install_stack
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
      --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  date -u; } 2>&1 | tee "$out/env.txt"
timeout 40 python3 -c 'import layer3_model as l3; c = l3.load_ceilings("cuda"); bf = c.flops["bf16"]
print(f"ceilings: {c.memory_bandwidth / 1e12:.2f} TB/s copy, bf16 {bf / 1e12:.0f} TFLOP/s")' 2>&1 \
    | tail -1 | tee -a "$out/env.txt"

maybe pytest_gpu 100 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/layer1/test_flash_attention_varlen.py tests/layer3/test_prefill_attention.py \
    tests/layer3/test_fused_decode.py tests/layer1/test_paged_decode.py \
    tests/layer4/test_paged_attention.py tests/layer4/test_cuda_graph_runner.py \
    tests/layer3/test_prefill_graph.py tests/layer4/test_speculative_graph.py
tail -3 "$out/pytest_gpu.log"
maybe sweep_8b 150 python3 benchmarks/backend_sweep.py --shape 8b --budget-s 135 --out "$out" \
    ${SWEEP_ARGS:-}
grep -E "step |engine |top|us  x" "$out/sweep_8b.log" | tail -40
maybe sweep_1b 100 python3 benchmarks/backend_sweep.py --shape 1b --budget-s 85 --out "$out" \
    ${SWEEP_ARGS:-}
maybe kernel 50 stack bench --layer 4 --only kernel
maybe decode 45 python3 benchmarks/decode_prefill_engine.py decode --out "$out"
maybe engine 65 python3 benchmarks/decode_prefill_engine.py engine --out "$out"
maybe prefill 45 python3 benchmarks/decode_prefill_engine.py prefill --out "$out"
maybe paged32 45 python3 benchmarks/sweep_paged.py --shapes 32:1024,32:4096,32:16384 \
    --configs 4,5,10,11,12 --splits 1,2,3,4 --budget-s 35 --out "$out"
grep -A5 "^batch context" "$out/paged32.log" 2>/dev/null

{ echo "== summary ($(date -u), $SECONDS s; JSON and logs under \$OUT) =="
  cat "$out/env.txt"
  tail -3 "$out/pytest_gpu.log" 2>/dev/null
  for s in 8b 1b; do [ -f "$out/backend_sweep_$s.json" ] && python3 benchmarks/backend_sweep.py \
      --table-from "$out/backend_sweep_$s.json"; done
  grep -v "Warning\|sdpa(q" "$out/kernel.log" 2>/dev/null | grep -E "^ +[0-9]+ +[0-9]+ " | head -16
  python3 benchmarks/decode_prefill_engine_summary.py "$out" 2>&1 | head -12
  grep -A5 "^batch context" "$out/paged32.log" 2>/dev/null; } | tee "$out/summary.txt"
