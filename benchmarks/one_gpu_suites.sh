#!/usr/bin/env bash
# The single-GPU device work side by side, each suite on a GPU of its own, in ONE call to a
# 4-GPU machine (< 600 s; carry .whl):
#   bash benchmarks/one_gpu_suites.sh
#   GPU 0  structured_gpu.sh   constrained decoding: kernel tests, mask overhead, tok/s ratio
#   GPU 1  backend_sweep.sh    triton vs torch backend, decode/prefill/engine rows
#   GPU 2  pytest -m gpu, layers 0-3, then layer 1's matmul bench (`stack bench --layer 1
#          --groups matmul --no-demos`: bf16 and int8 rows)
#   GPU 3  pytest -m gpu, layers 4-6, labs, CLI
# Each suite measures its own baseline in its own process on its own GPU, so ratios stay
# within one GPU; absolute numbers share the host's CPUs and memory with the other three
# (64 cores there: the suites' host threads do not compete for cores). Output: one folder per
# suite under $OUT, packed into suites.tgz; each suite's summary is printed last.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
logs=$out; . "$(dirname "$0")/device_steps.sh"
install_stack
export PYTHONUNBUFFERED=1 LLM_STACK_CACHE=/tmp/llm-stack-cache
gpus=$(nvidia-smi -L | wc -l)
[ "$gpus" -ge 4 ] || { echo "needs 4 GPUs, $gpus here: run the suites one call each"; exit 2; }
T="python3 -m pytest -m gpu -v -rfE -p no:cacheprovider --timeout 90 --durations=15 --continue-on-collection-errors"
suite() {  # suite GPU NAME CMD...: in the background, on that GPU, into $out/NAME
    local gpu=$1 name=$2; shift 2; mkdir -p "$out/$name"
    ( export CUDA_VISIBLE_DEVICES=$gpu OUT=$out/$name LLM_STACK_RESULTS=$out/$name/results
      logs=$out/$name; "$@" >"$out/$name/run.log" 2>&1; echo "exit $?" >>"$out/$name/run.log" ) &
}
suite 0 structured timeout -k 10 540 bash benchmarks/structured_gpu.sh
suite 1 sweep env TOTAL_S=540 bash benchmarks/backend_sweep.sh
low() {
    step pytest 430 $T tests/layer0 tests/layer1 tests/layer2 tests/layer3
    step matmul 110 python3 -m layer7_app.cli bench --layer 1 --groups matmul --no-demos
}
suite 2 tests_low low
suite 3 tests_high step pytest 540 $T tests/layer4 tests/layer5 tests/layer6 tests/labs tests/test_cli.py
wait
for s in structured sweep; do echo "===== $s"; tail -45 "$out/$s/run.log" | cut -c1-160; done
for s in tests_low tests_high; do echo "===== $s"
    grep -E "FAILED|ERROR|Timeout|passed|failed" "$out/$s/pytest.log" | tail -15 | cut -c1-200; done
echo "===== matmul"; tail -30 "$out/tests_low/matmul.log" | cut -c1-160
tar czf "$out/suites.tgz" -C "$out" structured sweep tests_low tests_high && \
    rm -rf "$out/structured" "$out/sweep" "$out/tests_low" "$out/tests_high"
