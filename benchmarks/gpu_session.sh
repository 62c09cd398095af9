#!/usr/bin/env bash
# One device-machine call: install, run the GPU tests, run the benchmarks, keep the logs.
# Usage (on the GPU machine, from the repo root): bash benchmarks/gpu_session.sh [PYTEST_ARGS] -- LAYER...
# Logs and results go to /tmp/gpu-out, packed at the end into $OUT/gpu-out.tgz
# (the device tool brings back only a few files).
set -uo pipefail
work=/tmp/gpu-out; mkdir -p "$work"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS="$work/results" LLM_STACK_CACHE="$work/cache"
pytest_args=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do pytest_args+=("$1"); shift; done; shift || true
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$work/install.log" 2>&1 || { cat "$work/install.log"; exit 1; }
{ nvidia-smi; python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'; } 2>&1 | tee "$work/env.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider "${pytest_args[@]}" 2>&1 | tee "$work/pytest_gpu.log" | tail -30
for layer in "$@"; do
    stack bench --layer "$layer" 2>&1 | tee "$work/bench_layer$layer.log"
done
[ -n "${OUT:-}" ] && tar czf "$OUT/gpu-out.tgz" -C /tmp gpu-out
