#!/usr/bin/env bash
# One device-machine call for layers 5 to 7, on one GPU:
#   bash benchmarks/upper_layers_gpu.sh tests   # pytest -m gpu over every layer and lab
#   bash benchmarks/upper_layers_gpu.sh bench   # layer 5 TP=1 vs layer 4, layer 6 HTTP vs offline,
#                                            # SmolLM2-shape vs transformers, layer 0/1 rooflines
# The machine lacks fastapi, uvicorn, pydantic, openai, gguf, rank-bm25: carry them as wheels in
# .whl/ (see the device README). Every step has its own time limit; logs and JSON are packed
# into $OUT/session.tgz at the end (the tool brings back at most 8 files).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/logs/results LLM_STACK_CACHE=/tmp/llm-stack-cache
logs=$out/logs; . "$(dirname "$0")/device_steps.sh"
install_stack
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers, fastapi
print("torch", torch.__version__, "triton", triton.__version__, "transformers",
      transformers.__version__, "fastapi", fastapi.__version__)'; } 2>&1 | tee "$out/logs/env.txt"

case ${1:-tests} in
tests)
    step pytest_gpu 480 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 \
        --continue-on-collection-errors tests/layer0 tests/layer1 tests/layer2 tests/layer3 \
        tests/layer4 tests/layer5 tests/layer6 tests/labs tests/test_cli.py
    grep -E "passed|failed|FAILED|ERROR" "$out/logs/pytest_gpu.log" | tail -30 ;;
bench)
    step bench_layer5 150 stack bench --layer 5 --no-training
    tail -25 "$out/logs/bench_layer5.log"
    step bench_layer6 150 stack bench --layer 6 --num-prompts 256 --input-len 128 \
        --output-len 128 --rates 8,32,inf
    tail -25 "$out/logs/bench_layer6.log"
    step smollm2_shape 120 python3 benchmarks/smollm2_bench.py --model smollm2-shape \
        --device cuda --out "$out/logs"
    tail -15 "$out/logs/smollm2_shape.log"
    step bench_layer0 60 stack bench --layer 0
    tail -12 "$out/logs/bench_layer0.log"
    step bench_layer1 120 stack bench --layer 1
    tail -5 "$out/logs/bench_layer1.log" ;;
esac
tar czf "$out/session.tgz" -C "$out" logs && rm -rf "$out/logs"
