#!/usr/bin/env bash
# Layer 5 on 2 GPUs: the multi-GPU tests on this tree, then data vs tensor vs pipeline
# parallelism on nano-vllm's workload (layer5_parallel/bench/dp.py). Run from the repo root,
# or with OVERLAY=dir holding a copy of layer5_parallel/ and tests/; results under OUT.
# usage: benchmarks/parallel_forms_gpu.sh [layouts (1,dp,tp)] [test seconds (120)] [bench seconds (600)]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD; SRC=${OVERLAY:-.}; OUT=${OUT:-$ROOT/results/layer5}; mkdir -p "$OUT"
export PYTHONPATH=$ROOT/$SRC:$ROOT
LAYOUTS=${1:-1,dp,tp}; TEST_S=${2:-120}; BENCH_S=${3:-600}
for pkg in llguidance gguf; do  # layer 4 imports them; a bare GPU machine may lack them
  python3 -c "import $pkg" 2>/dev/null || { ls "$ROOT"/.whl/$pkg-*.whl >/dev/null 2>&1 && \
    python3 -m pip install -q --no-deps "$ROOT"/.whl/$pkg-*.whl; }
done
{ nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; date -u; } > "$OUT/env.txt" 2>&1
cd "$ROOT/$SRC"  # this tree's packages first (python -m puts the working directory first)
if [ "$TEST_S" -gt 0 ]; then
  timeout "$TEST_S" python3 -m pytest -q -m multigpu tests/layer5 -c "$ROOT/pyproject.toml" \
      --rootdir . -p no:cacheprovider -o addopts= -rA 2>&1 | tail -40 > "$OUT/multigpu.txt"
fi
timeout "$BENCH_S" python3 -m layer5_parallel.bench.dp --dp 2 --layouts "$LAYOUTS" \
    --out "$OUT/dp_${LAYOUTS//,/_}.json" 2>&1 | grep --line-buffered -v Warning \
    > "$OUT/dp_${LAYOUTS//,/_}.txt"
