#!/usr/bin/env bash
# One device-machine call for layers 3 and 4 (issues 5 and 6): install, GPU tests, benchmarks.
# Usage (on the GPU machine, from the repo root):
#   bash benchmarks/l34_session.sh tests     # pytest -m gpu on layers 3-4 + layer 3 bench + kernel bench
#   bash benchmarks/l34_session.sh engine    # stack bench --layer 4 (throughput, prefix, GPU speculation)
# Every step has its own time limit so one hang cannot eat the call; logs go to $OUT.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/results LLM_STACK_CACHE=/tmp/llm-stack-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'; } 2>&1 | tee "$out/env.txt"
python3 -c 'import layer3_model as l3; c = l3.load_ceilings("cuda"); print(f"ceilings: {c.memory_bandwidth/1e12:.2f} TB/s, bf16 {c.flops["bf16"]/1e12:.0f} TFLOP/s")'

step() {  # step NAME SECONDS CMD...: run with a limit, log to $out/NAME.log, say how it ended
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - t0)) s"
}
case ${1:-tests} in
tests)
    step pytest_gpu 230 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 90 tests/layer3 tests/layer4 tests/labs/test_lab3.py
    tail -8 "$out/pytest_gpu.log"
    step bench_layer3 220 stack bench --layer 3
    tail -22 "$out/bench_layer3.log"
    step bench_kernel 100 stack bench --layer 4 --only kernel
    tail -22 "$out/bench_kernel.log" ;;
engine)
    step bench_layer4 540 stack bench --layer 4 --no-cpu --spec-devices cuda --spec-repeats 2
    tail -40 "$out/bench_layer4.log" ;;
esac
