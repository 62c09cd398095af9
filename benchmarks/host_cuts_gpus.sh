#!/usr/bin/env bash
# Rank 0's fixed host cost per decode step after the cuts (the decode graphs' own argmax, pooled
# pinned token copies, run_host's cached views and skipped table rows, the workers' paused spin),
# in ONE bounded device call (~90 s expected, <= 200 s bound):
#   bash benchmarks/host_cuts_gpus.sh     (kind nvidia-h100-x4; carry .whl: layer 4 imports
#                                          llguidance)
# Steps, each with its own limit, logs and JSON under $OUT:
#   tests  pytest -m "gpu or multigpu": graph replay = eager with the graph's greedy tokens equal
#          to the logits' argmax (device, host and alternating inputs), the engine on one GPU
#          with graphs (greedy = layer 3; async = sync; graph argmax = eager engine, logprobs and
#          sampled rows beside greedy ones), TP=4 graphs on every rank (ours) = TP=1's tokens
#   tp     tp_gpu_bench, Llama-3.1-8B shape: TP=1 and TP=4 ours, the workers pausing 20 us while
#          they spin (the default now) and busy-spinning (pause 0: the old default), batch 1 and
#          32: tok/s, host ms/step, rank 0's phases and python probe (compare FACTS.md's table)
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
logs=$out; . "$(dirname "$0")/device_steps.sh"
TOTAL_S=${TOTAL_S:-200}
gpu_session "gpu or multigpu"
gpu_tests 80 "tests/layer4/test_cuda_graph_runner.py tests/layer4/test_async_scheduling_gpu.py tests/layer4/test_engine_gpu.py::test_greedy_outputs_equal_layer3_on_cuda 'tests/layer5/test_tp_graph_gpu.py::test_tp4_bf16_llama_shape_graphs_equal_tp1_tokens[ours]'"
[ "$gpus" -ge 4 ] && maybe tp 115 python3 -m layer5_parallel.bench.tp_gpu_bench \
    --shapes llama-3.1-8b --tps 4 --tp-backends ours --worker-pause 2e-5,0 --repeats 2 \
    --phase-timeout 100 --out "$out"
grep -svE "^\s*$|starting|spawned|joined|built|KV caches|captured|engine up|warm-up|closed" \
    "$out/tp.log" | tail -100
echo "== done in $SECONDS s"
