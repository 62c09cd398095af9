#!/usr/bin/env bash
# Rank 0's host time per decode step on GPUs, in ONE device call (<= ~560 s):
#   bash benchmarks/host_time_gpus.sh     (kind nvidia-h100-x4, or -x2; carry .whl: layer 4
#                                          imports llguidance)
# Steps, each with its own limit, logs and JSON under $OUT:
#   tests  pytest -m "gpu or multigpu": the decode graphs fed from the host (run_host: positions,
#          lengths and the bucket's table rows in two pinned copies; device, host and alternating
#          inputs equal the eager model, padding in the scratch block), the engine on one GPU with
#          graphs and async scheduling (in-order ids as a view of last step's tokens), pinned
#          staging, TP graphs on every rank (TP=2/4), PP stage graphs (their buffers are views of
#          the same static tensors)
#   tp     tp_gpu_bench on the Llama-3.1-8B shape: TP=1 and TP=N (N = the GPUs), layer 2's
#          all-reduce, batch 1 and 32, host ms / step and rank 0's step by phase (the rows of
#          BENCHMARKS.md's "Layer 5 on 4 GPUs, second round" to compare against)
# Target (issue: layer 5 on GPUs): host time at TP=4 <= 1.3x TP=1's.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
logs=$out; . "$(dirname "$0")/device_steps.sh"
gpu_session "gpu or multigpu"
gpu_tests 200 "tests/layer4/test_cuda_graph_runner.py tests/layer4/test_engine_gpu.py tests/layer4/test_async_scheduling_gpu.py tests/layer4/test_model_runner.py tests/layer5/test_tp_graph_gpu.py tests/layer5/test_pp_engine_gpu.py"
[ "$gpus" -ge 2 ] && maybe tp 330 python3 -m layer5_parallel.bench.tp_gpu_bench \
    --shapes llama-3.1-8b --tps "$gpus" --tp-backends ours --repeats 2 --phase-timeout 150 --out "$out"
grep -sE "tok/s|host|TP=|FAILED" "$out/tp.log" | tail -30
echo "== done in $SECONDS s"
