#!/usr/bin/env bash
# One device-machine call for layers 3 and 4: install, GPU tests, benchmarks.
# Usage (on the GPU machine, from the repo root):
#   bash benchmarks/layer3_layer4_gpu.sh tests     # pytest -m gpu on layers 3-4 + layer 3 bench + kernel bench
#   bash benchmarks/layer3_layer4_gpu.sh engine    # stack bench --layer 4 (throughput, prefix, GPU speculation)
#   bash benchmarks/layer3_layer4_gpu.sh profile   # engine step breakdown, paged-kernel split sweep, layer-3 decode kernels
# Every step has its own time limit so one hang cannot eat the call; logs go to $OUT.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/results LLM_STACK_CACHE=/tmp/llm-stack-cache
logs=$out; . "$(dirname "$0")/device_steps.sh"
install_stack
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'; } 2>&1 | tee "$out/env.txt"
python3 -c 'import layer3_model as l3; c = l3.load_ceilings("cuda"); print(f"ceilings: {c.memory_bandwidth/1e12:.2f} TB/s, bf16 {c.flops["bf16"]/1e12:.0f} TFLOP/s")'

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
profile)  # where the time goes: engine decode steps, the paged kernel's split counts, a layer-3 decode step
    step profile_engine256 200 python3 benchmarks/profile_engine.py --seqs 256
    cat "$out/profile_engine256.log"
    step profile_engine64 120 python3 benchmarks/profile_engine.py --seqs 64
    head -12 "$out/profile_engine64.log"
    step kernel_sweep 150 python3 -c "from layer4_algorithms.bench.paged_attention import bench_paged_decode as b; b(batches=(1, 4, 32, 128), contexts=(512, 1024, 4096, 16384), splits=(None, 1, 2, 4, 8, 16, 32, 64))"
    grep -v "Warning\|sdpa(q" "$out/kernel_sweep.log"
    step profile_decode 100 python3 benchmarks/profile_decode.py --backend triton
    cat "$out/profile_decode.log" ;;
final)  # after host-overhead and split changes: GPU tests again, then the layer-4 GPU bench (throughput, prefix, kernel)
    step pytest_gpu 160 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 tests/layer4 tests/layer3/test_decode_hook.py tests/layer3/test_quantize_graph.py
    tail -4 "$out/pytest_gpu.log"
    step bench_layer4 320 stack bench --layer 4 --no-cpu --no-spec
    grep -v "Warning\|sdpa(q" "$out/bench_layer4.log" | tail -45
    step profile_engine256 80 python3 benchmarks/profile_engine.py --seqs 256 --steps 10
    head -9 "$out/profile_engine256.log" ;;
esac
