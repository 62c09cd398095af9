#!/usr/bin/env bash
# Layer 5's tensor-parallel GPU runtime on 2+ GPUs: the multi-GPU TP tests (CUDA graphs on every
# rank, the shared-memory step ring, faults), then decode tokens/s of the Llama-3.2-1B and
# Llama-3.1-8B shapes at TP=1/2(/4) with graphs on, NCCL and layer 2's PeerAllReduce
# (tp_backend ours), host time per step, the planner's step beside the measured one
# (layer5_parallel/bench/tp_gpu_bench.py -> tp_gpu.json, tp_gpu.png). Run from the repo root, or with
# OVERLAY=dir holding a copy of the changed packages and tests/; results under OUT.
# usage: benchmarks/tp_graphs_gpu.sh [test seconds (150)] [bench seconds (240)] [backends (torch,ours)]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD; SRC=${OVERLAY:-.}; OUT=${OUT:-$ROOT/results/layer5}; mkdir -p "$OUT"
export PYTHONPATH=$ROOT/$SRC:$ROOT LLM_STACK_MODELS=${LLM_STACK_MODELS:-$ROOT/models}
TEST_S=${1:-150}; BENCH_S=${2:-240}; BACKENDS=${3:-torch,ours}
for pkg in llguidance gguf; do  # layer 4 imports them; a bare GPU machine may lack them
  python3 -c "import $pkg" 2>/dev/null || { ls "$ROOT"/.whl/$pkg-*.whl >/dev/null 2>&1 && \
    python3 -m pip install -q --no-deps "$ROOT"/.whl/$pkg-*.whl; }
done
{ nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; date -u; } > "$OUT/env.txt" 2>&1
cd "$ROOT/$SRC"
# -s: each test's own diagnosis (first differing token, margins) prints as it runs, so a run the
# outer timeout cuts still shows it; -k: SIGKILL 10 s after the SIGTERM (workers die with rank 0)
if [ "$TEST_S" -gt 0 ]; then  # thread timeouts: a test stuck in a CUDA call still shows its stacks
  timeout -k 10 "$TEST_S" python3 -m pytest -v -s -m multigpu tests/layer5/test_tp_graph_gpu.py \
      tests/layer5/test_tp_gpu.py -c "$ROOT/pyproject.toml" --rootdir . -p no:cacheprovider \
      -o addopts= -rA --timeout 100 --timeout-method=thread > "$OUT/tp_multigpu.txt" 2>&1
fi
# the small shape first; progress lines (elapsed s) as each phase ends; any phase > 120 s: stacks
timeout -k 10 "$BENCH_S" python3 -m layer5_parallel.bench.tp_gpu_bench \
    --shapes llama-3.2-1b,llama-3.1-8b --tp-backends "$BACKENDS" --out "$OUT" \
    --phase-timeout 120 2>&1 | grep --line-buffered -v Warning > "$OUT/tp_gpu.txt"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/tp_gpu.txt" 2>&1  # none left
