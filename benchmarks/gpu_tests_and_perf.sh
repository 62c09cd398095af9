#!/usr/bin/env bash
# Every GPU test, then the headline performance rows, on one H100, each call under 10 minutes:
#   bash benchmarks/gpu_tests_and_perf.sh tests   # pytest -m gpu, every layer + labs (-v: a timeout
#                                            # still shows where it stopped; ~450 s on an H100)
#   bash benchmarks/gpu_tests_and_perf.sh perf    # decode/prefill/engine table (decode_prefill_engine.sh), then layer 6's
#                                            # bench beside transformers serve
# Carry .whl (fastapi, uvicorn, openai, ...). Logs and JSON packed into $OUT/session.tgz.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/logs/results LLM_STACK_CACHE=/tmp/llm-stack-cache
logs=$out/logs; . "$(dirname "$0")/device_steps.sh"
install_stack
case ${1:-tests} in
tests)
    step pytest_gpu 540 python3 -m pytest -m gpu -v -rfE -p no:cacheprovider --timeout 90 \
        --durations=25 --continue-on-collection-errors tests/layer0 tests/layer1 tests/layer2 \
        tests/layer3 tests/layer4 tests/layer5 tests/layer6 tests/labs tests/test_cli.py
    grep -E "FAILED|ERROR|Timeout|passed|failed" "$out/logs/pytest_gpu.log" | tail -25 ;;
perf)
    OUT=$out/logs bash benchmarks/decode_prefill_engine.sh 2>&1 | tail -32
    step bench_layer6 160 stack bench --layer 6 --num-prompts 192 --input-len 128 \
        --output-len 128 --rates inf --low-load-prompts 8 --peer transformers --out "$out/logs/layer6"
    rm -rf "$out/logs/layer6/models"
    grep -v '^ *$' "$out/logs/bench_layer6.log" | tail -22 ;;
esac
tar czf "$out/session.tgz" -C "$out" logs && rm -rf "$out/logs"
