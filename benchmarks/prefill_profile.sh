#!/usr/bin/env bash
# Prefill MFU, profiled, in one device-machine call, under 4 minutes:
#   bash benchmarks/prefill_profile.sh
# 1. decode_prefill_engine.py prefill: the table's figure (5 runs after a same-shape warm-up), cold machine
# 2. profile_prefill.py: kernel tables (triton, torch), op-swap variants, host enqueue time,
#    CUDA-graph replay, GEMMs alone, flash-attention tile sweep at the prefill's layout
# 3. decode_prefill_engine.py prefill again (warm machine): cold == warm is the check
# 4. layer 1's flash-attention GPU tests
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/results LLM_STACK_CACHE=/tmp/llm-stack-cache
logs=$out; . "$(dirname "$0")/device_steps.sh"
install_stack
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
    --format=csv,noheader; lscpu | grep "Model name"; nproc; uptime; } 2>&1 | tee "$out/env.txt"
timeout 40 python3 -c 'import layer3_model as l3; c = l3.load_ceilings("cuda"); bf = c.flops["bf16"]
print(f"ceilings: {c.memory_bandwidth / 1e12:.2f} TB/s copy, bf16 {bf / 1e12:.0f} TFLOP/s")' 2>&1 \
    | tail -1 | tee -a "$out/env.txt"
step prefill_cold 45 python3 benchmarks/decode_prefill_engine.py prefill --out "$out"
mv "$out/prefill.json" "$out/prefill_cold.json" 2>/dev/null
step profile ${PROFILE_S:-110} python3 benchmarks/profile_prefill.py --json "$out/profile_prefill.json" ${PROFILE_ARGS:-}
step pytest_flash ${PYTEST_S:-30} python3 -m pytest -q -p no:cacheprovider -x -m gpu \
    tests/layer1/test_flash_attention.py tests/layer1/test_flash_config.py tests/layer3/test_prefill_attention.py
tail -2 "$out/pytest_flash.log"
step prefill 35 python3 benchmarks/decode_prefill_engine.py prefill --out "$out"
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$out/env.txt"
grep -v "^USDT\|profiler_st" "$out/profile.log" | head -80
tail -1 "$out/prefill_cold.log"; tail -1 "$out/prefill.log"
