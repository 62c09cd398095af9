#!/usr/bin/env bash
# Batch-1 decode against its memory-bandwidth roofline in one GPU call, every step under `timeout`:
#   decode   fused decode (with / without PDL) vs the general path (decode_prefill_engine.py decode)
#   tests    the GPU tests of the fused path, the decode kernels, the paged kernel, the engine
#   kernels  GEMV tile sweep vs cuBLAS, fused prologues, split decode attention
#            (decode_kernels_bench.py) -> decode_kernels.json
#   tuned    the decode bench again with the sweep's tiles
#   profile  kernels of one eager fused decode step (profile_decode.py)
#   paged    paged decode kernel vs SDPA at the layer-4 bench shapes, graph replay, configs
# Usage: OUT=dir bash benchmarks/decode_kernels.sh   (worst case ~290 s)
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/results LLM_STACK_CACHE=/tmp/llm-stack-cache
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
logs=$out; . "$(dirname "$0")/device_steps.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step decode 70 python3 benchmarks/decode_prefill_engine.py decode --out "$out"
tail -1 "$out/decode.log"
step tests 80 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/layer3/test_fused_decode.py \
    tests/layer1/test_gemv.py tests/layer4/test_paged_attention.py \
    tests/layer4/test_cuda_graph_runner.py tests/layer4/test_engine_gpu.py
grep "^step\|passed\|failed" "$out/tests.log" | tail -16
step kernels 40 python3 benchmarks/decode_kernels_bench.py --out "$out"
grep -v "^TUNED" "$out/kernels.log" | tail -12; grep "^TUNED" "$out/kernels.log"
mkdir -p "$out/tuned"
[ -f "$out/decode_kernels.json" ] && step tuned 35 python3 benchmarks/decode_prefill_engine.py decode \
    --fused-only --out "$out/tuned" --gemv-tuned "$out/decode_kernels.json" \
    && tail -1 "$out/tuned.log"
step profile 25 python3 benchmarks/profile_decode.py
grep -v Warn "$out/profile.log" | head -9
step paged 50 python3 benchmarks/decode_kernels_bench.py --paged-only --out "$out"
grep "^paged" "$out/paged.log"
