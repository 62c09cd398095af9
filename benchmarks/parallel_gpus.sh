#!/usr/bin/env bash
# Layers 2 and 5 on every GPU of one machine (2 or 4), in ONE device call (<= ~570 s):
#   bash benchmarks/parallel_gpus.sh                  (carry .whl: layer 4 imports llguidance)
#   ONLY="tests_l2 dp tp_1b" bash benchmarks/parallel_gpus.sh   (a second call: what the first skipped)
# Steps, in order of importance, each with its own limit and only if it fits in TOTAL_S (560 s);
# logs and JSON under $OUT, a summary last. ONLY="tp_8b dp": just those.
#   tests_tp     pytest -m multigpu: TP with CUDA graphs on every rank equals TP=1 (course model
#                fp32, bf16 Llama shape: logits, near-ties), TP=2 NCCL equals TP=1, a worker
#                dying / hanging in a graph step fails rank 0 with one error in time
#   tests_forms  DP=N equals one engine, PP=2 equals PP=1, TP=2 x PP=2 (4 GPUs)
#   tests_l2     layer 2's peer-memory all-reduce equals NCCL (every dtype, odd sizes, graphs)
#   tp_8b        (TP_8B_S: its limit, 150 s) decode tok/s of the Llama-3.1-8B shape at TP=1..N, NCCL and layer 2's
#                all-reduce, batch 1 and 32, host ms per step, the planner's step
#                (layer5_parallel/bench/tp_gpu_bench.py -> tp_gpu.json, tp_gpu.png)
#   pp_p2p       whether the pipeline's p2p order deadlocks on one NCCL communicator (pp_p2p_probe.py)
#   dp           nano-vllm's workload on the 1B shape: 1 GPU, DP=N, PP=N (layer5_parallel/bench/dp.py)
#   tp_1b        the TP bench on the Llama-3.2-1B shape
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
logs=$out; . "$(dirname "$0")/device_steps.sh"
gpu_session "multigpu"
maybe tests_tp 170 bash -c "$T tests/layer5/test_tp_graph_gpu.py tests/layer5/test_tp_gpu.py"; verdicts tests_tp
maybe tests_forms 90 bash -c "$T tests/layer5/test_forms_gpu.py tests/layer5/test_pp_engine_gpu.py"; verdicts tests_forms
maybe tests_l2 80 bash -c "$T tests/layer2/test_peer_all_reduce.py"; verdicts tests_l2 5
maybe tp_8b "${TP_8B_S:-150}" python3 -m layer5_parallel.bench.tp_gpu_bench --shapes llama-3.1-8b \
    --tp-backends torch,ours --phase-timeout 90 --out "$out"
grep -s "tok/s" "$out/tp_8b.log" | cut -c1-150
# does one NCCL communicator deadlock the pipeline's hand-offs once they outgrow NCCL's buffers?
# (the engine now sends the logits back on a group of their own: this says whether it must)
maybe pp_p2p 120 python3 benchmarks/pp_p2p_probe.py --out "$out/p2p" --hang-s 10
tail -14 "$out/pp_p2p.log" 2>/dev/null
maybe dp 200 python3 -m layer5_parallel.bench.dp --dp "$gpus" --layouts 1,dp,ppN --out "$out/dp.json"
grep -s "tok/s" "$out/dp.log" | tail -6
maybe tp_1b 90 python3 -m layer5_parallel.bench.tp_gpu_bench --shapes llama-3.2-1b \
    --tp-backends torch,ours --phase-timeout 60 --out "$out/1b"
echo "== done in $SECONDS s"
