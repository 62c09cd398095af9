#!/usr/bin/env bash
# Pipeline parallelism with steps in flight on 4 GPUs (or 2), in ONE device call (<= ~560 s):
#   bash benchmarks/pp_in_flight_gpus.sh        (kind nvidia-h100-x4; carry .whl: layer 4 imports llguidance)
# Steps, each with its own limit, logs and JSON under $OUT, a summary last:
#   tests  pytest -m "gpu or multigpu": PP=2 NCCL and PP=2 stage graphs equal PP=1, steps in flight
#          (as many as stages, up to 4, eager and stage graphs, a pool small enough to preempt)
#          equal PP=1, the stage graphs on one GPU, DP/PP/TPxPP forms (test_forms_gpu.py)
#   pp     nano-vllm's workload on the Llama-3.2-1B shape (256 sequences, random bf16 weights,
#          triton kernels), every layout in its own processes and measured in this one run:
#          1 GPU (CUDA graphs) | PP=2 with 2 steps in flight | PP=N with N in flight | PP=2
#          drained (2 micro-batches, stage graphs: 0.80x last time) | PP=2 with 3 in flight |
#          PP=N drained (N micro-batches: 0.73x at N=4); all with stage graphs; tokens/s as a
#          ratio to 1 GPU, ms and host ms per (lane) step, same tokens; layouts in order of
#          importance, none started past 300 s (layer5_parallel/bench/dp.py)
# Target (issue: layer 5 on GPUs): PP=2 >= 1.4x one GPU's tokens/s.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
logs=$out; . "$(dirname "$0")/device_steps.sh"
gpu_session "gpu or multigpu"
gpu_tests 170 "tests/layer5/test_pp_engine_gpu.py tests/layer5/test_pp_stage_graphs.py tests/layer5/test_forms_gpu.py"
maybe pp 370 python3 -m layer5_parallel.bench.dp --dp "$gpus" --layouts 1,pp2gf,pp1gf,pp2g,pp2gF,ppNg \
    --layout-timeout 150 --budget-s 300 --out "$out/pp_in_flight.json"
grep -sE "tok/s|replica|FAILED|skipped" "$out/pp.log" | tail -16
echo "== done in $SECONDS s"
