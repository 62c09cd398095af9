#!/usr/bin/env bash
# The batch-1 decode GEMVs at every per-rank tensor-parallel shape, on one GPU, each step under
# `timeout` (worst case ~220 s; usually well under 200):
#   sweep  launch configs per shape vs a copy of the same bytes, then each layout's layer chain
#          with the old / current / best configs, PDL early trigger off and on
#          (gemv_shapes_sweep.py) -> gemv_shapes.json, sweep.log
#   tests  the shape-table tiles against the references (bf16, compiled), the fused decode
#          path's GPU tests
# Usage: OUT=dir bash benchmarks/gemv_shapes.sh
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
logs=$out; . "$(dirname "$0")/device_steps.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
step sweep 170 python3 benchmarks/gemv_shapes_sweep.py --out "$out" --compile-s 70 --budget-s 50 \
    --chain-compile-s 20 --deadline-s 150
grep -A40 "^== best" "$out/sweep.log"; grep "^\[.*chain" "$out/sweep.log"
t1=tests/layer1/test_gemv.py t3=tests/layer3/test_fused_decode.py
step tests 50 python3 -m pytest -q -p no:cacheprovider "$t1::test_tuned_tiles_at_awkward_sizes" \
    "$t1::test_tuned_shapes_gpu" "$t3::test_fused_decode_1b_shape_gpu" \
    "$t3::test_fused_decode_under_cuda_graph_gpu"
grep "passed\|failed\|error" "$out/tests.log" | tail -6
