#!/usr/bin/env bash
# One device-machine call: install, run the benchmarks, then the GPU tests.
# Usage (on the GPU machine, from the repo root):
#   bash benchmarks/layer_benches_gpu.sh "LAYERS" [PYTEST_ARGS...]     e.g.  "0 1" tests/layer1
# Logs go to $OUT (the device tool brings back at most 8 files, so results are packed
# into one results.tgz); without $OUT, to ./gpu-out.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
layers=${1:-}; shift || true
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=/tmp/llm-stack-results LLM_STACK_CACHE=/tmp/llm-stack-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
{ nvidia-smi; python3 -c 'import torch, triton, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "cupy", cupy.__version__)'; } >"$out/env.txt" 2>&1
for layer in $layers; do
    stack bench --layer "$layer" >"$out/bench_layer$layer.log" 2>&1
    echo "bench layer $layer: exit $?"
done
[ -n "$layers" ] && tar czf "$out/results.tgz" -C /tmp llm-stack-results llm-stack-cache
python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest_gpu.log" | tail -15
