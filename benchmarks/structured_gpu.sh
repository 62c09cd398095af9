#!/usr/bin/env bash
# Structured outputs on one GPU (~200-300 s on an H100; carry .whl: llguidance):
#   timeout 300 bash benchmarks/structured_gpu.sh
# 1. pytest -m gpu tests/layer4/test_structured_gpu.py: the Triton bitmask kernel equals the
#    torch reference (and both times, printed), constrained rows under CUDA graphs and draft
#    speculation, and under CUDA graphs with async scheduling with the apply replayed from
#    CUDA graphs (greedy and sampled): the same outputs as plain launches; MaskGraphs alone.
# 2. benchmarks/structured_bench.py: compile per schema (first, cached), mask fill and apply per
#    step at batch 32, constrained vs unconstrained tok/s at batch 32 (eager and CUDA graphs,
#    default scheduling and synchronous; under CUDA graphs also with the apply launched
#    plainly), and with SHAPE=llama-3.2-1b the async CUDA-graph row on random weights of that
#    shape -> $OUT/structured_bench.json.
# 3. benchmarks/structured_host_phases.py: the host's phases alone, on this host's CPU
#    -> $OUT/structured_host_phases.json.
# Logs in $OUT/*.log; the summary is the output's tail. A dry run of the script's flow on a CPU
# (no install, the bench's smoke sizes; the GPU tests skip):
#   SKIP_INSTALL=1 DEVICE=cpu OUT=/tmp/sg bash benchmarks/structured_gpu.sh
# Shorter: PYTEST_K=cuda_graphs PYTEST_S=100 BENCH_S=150 TIME_LIMIT=100 PHASES_S=40
# (the GPU tests of the CUDA-graph path only; bench modes that would start after 100 s skipped;
# PHASES_S=0 skips the host phases).
# REPEATS=N: each variant's best of N runs (default 2). PYTEST_TIMEOUT: seconds a GPU test may
# take before its stacks are printed and it fails (default 60).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
device=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 LLM_STACK_CACHE=/tmp/llm-stack-cache
logs=$out; . "$(dirname "$0")/device_steps.sh"
[ -n "${SKIP_INSTALL:-}" ] || install_stack
python3 -c "import os, torch, triton, llguidance; print(torch.cuda.get_device_name() \
if torch.cuda.is_available() else 'no GPU', 'torch', torch.__version__, 'triton', \
triton.__version__, 'llguidance', llguidance.__version__, 'cpus', os.cpu_count())"
step pytest_structured_gpu "${PYTEST_S:-150}" python3 -m pytest -m gpu -s -v -rfE -p no:cacheprovider \
    --timeout "${PYTEST_TIMEOUT:-60}" ${PYTEST_K:+-k "$PYTEST_K"} tests/layer4/test_structured_gpu.py
grep -E "apply \(|^masks|PASSED|FAILED|ERROR|SKIPPED|passed|failed|skipped" \
    "$out/pytest_structured_gpu.log" | tail -12
size=(--repeats "${REPEATS:-2}" --new-tokens 128)
[ "$device" = cuda ] || size=(--quick)
step structured_bench "${BENCH_S:-270}" python3 benchmarks/structured_bench.py --device "$device" \
    "${size[@]}" --time-limit "${TIME_LIMIT:-190}" ${SHAPE:+--shape "$SHAPE"} --out "$out"
grep -E "^\[|SUMMARY" "$out/structured_bench.log" | tail -30
# the host's phases on this machine's CPU (no GPU work): advance, fill, apply; per step at
# batch 32, 32 different schemas
if [ "${PHASES_S:-60}" != 0 ]; then
  step host_phases "${PHASES_S:-60}" python3 benchmarks/structured_host_phases.py --steps 96 \
      --out "$out"
  tail -16 "$out/host_phases.log"
fi
