#!/usr/bin/env bash
# A lone prompt's prefill through the engine on one GPU, in one device call under 340 s:
#   bash benchmarks/prefill_gpu.sh
# The host cuts before the replay (the "one" graph makes its positions and slots itself; run here
# inside a captured graph by layer 4's GPU tests) and the attention options:
# layer 1's flash kernel (the default) vs cuDNN's fused attention (EngineConfig.prefill_attention
# "cudnn", opt-in) vs the flash kernel in the HEADS_FIRST grid order (LLM_STACK_FLASH_HEADS_FIRST=1,
# opt-in): 1. their GPU tests and layer 4's prefill-graph ones; 2. prefill 2048 (1B) through the
# engine, flash then cuDNN; 3. the kernels alone (prefill_attention_sweep.py); 4. the engine with
# HEADS_FIRST; 5. this machine's CPU on the engine's host work around one prefill. Steps run in
# that order of importance; one that no longer fits TOTAL_S is skipped and said so.
# Read: summary.txt (graph_engine_MFU per variant, first tokens equal), the sweep's VERDICT lines.
# A variant that wins graph_engine_MFU with its tests passing becomes the default by one line:
# cuDNN -> `prefill_attention: str | None = None` in layer4_algorithms/config.py (cuDNN where it
# runs, flash elsewhere); HEADS_FIRST -> CAUSAL_HEADS_FIRST's default in flash_attention.py.
set -uo pipefail
top=${OUT:-gpu-out}; out=$top/prefill_attention; mkdir -p "$out"  # (all under one folder, tarred at the end)
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/results LLM_STACK_CACHE=/tmp/llm-stack-cache
unset LLM_STACK_FLASH_HEADS_FIRST
export TOTAL_S=330  # maybe(): a step starts only if its limit fits in what is left
logs=$out; . benchmarks/device_steps.sh
install_stack
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"cudnn", torch.backends.cudnn.version())'; } 2>&1 | tee "$out/env.txt"
# 1. GPU tests: cudnn_attention_tokens vs the reference (GQA, ragged, serving layout, CUDA-graph
#    replay); HEADS_FIRST == default order bit for bit, every table config; layer 3 logits cuDNN vs
#    flash eager and in CudaGraphPrefill; the engine with prefill_attention="cudnn" + prefill graphs
maybe pytest_gpu 130 python3 -m pytest -m gpu -q -s -p no:cacheprovider -o addopts= -rfE \
    --timeout 120 --durations=8 tests/layer1/test_cudnn_attention.py tests/layer1/test_flash_config.py \
    tests/layer3/test_cudnn_prefill_attention.py \
    tests/layer4/test_prefill_graph_runner.py tests/layer4/test_engine_gpu.py \
    tests/layer4/test_async_scheduling_gpu.py
grep -E "passed|failed|^FAILED|^ERROR|cudnn t=" "$out/pytest_gpu.log" | tail -14
# 2. prefill 2048 (1B) through the engine: flash (today), cuDNN (then, after the sweep, flash in
#    the HEADS_FIRST order)
maybe p_flash 40 python3 benchmarks/decode_prefill_engine.py prefill --out "$out/p_flash"
maybe p_cudnn 40 python3 benchmarks/decode_prefill_engine.py prefill --prefill-attention cudnn \
    --out "$out/p_cudnn"
# 3. the attention alone: 2048 tokens first (D 64, 128), then 512, 4096; the table's tiles and two
#    others, both grid orders, cuDNN (ours, aten op), SDPA cuDNN / flash backends
maybe sweep 70 python3 benchmarks/prefill_attention_sweep.py --out "$out/sweep" --quick --budget-s 45
grep -A60 "variant" "$out/sweep.log" | head -70
LLM_STACK_FLASH_HEADS_FIRST=1 maybe p_heads 40 python3 benchmarks/decode_prefill_engine.py prefill \
    --out "$out/p_heads"
maybe host_prefill 20 python3 benchmarks/engine_host_time.py --prefill 2048 --repeats 3
cat "$out/host_prefill.log"
echo "== prefill 2048 (1B): flash / cudnn / flash heads-first"
python3 - "$out" <<'PY' | tee "$top/summary.txt"
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
runs = {}
for name in ("p_flash", "p_cudnn", "p_heads"):
    try:
        runs[name] = json.loads((d / name / "prefill.json").read_text())
    except OSError:
        runs[name] = {"missing": "MISSING"}
for k in ("graph_engine_MFU", "graph_engine_host_before_replay_ms", "graph_engine_replay_gpu_MFU",
          "graph_engine_replay_gpu_ms",
          "engine_MFU", "bucket_graph_MFU", "MFU", "graph_tokens_equal", "prefill_attention",
          "flash_heads_first", "device"):
    print(f"  {k}: " + "  ".join(f"{n[2:]} {r.get(k, r.get('missing', '-'))}"
                                 for n, r in runs.items()))
base = runs["p_flash"].get("engine_first_tokens")
for n in ("p_cudnn", "p_heads"):
    other = runs[n].get("engine_first_tokens")
    if base and other:  # greedy first tokens of the same 7 random prompts (bf16: ties may differ)
        same = sum(a == b for a, b in zip(base, other))
        print(f"  first tokens {n[2:]} == flash: {same}/{len(base)}")
try:
    sweep = json.loads((d / "sweep" / "prefill_attention_sweep.json").read_text())
    for v in sweep["verdicts"]:
        print("  sweep", json.dumps(v))
except OSError as e:
    print("  sweep: missing", e)
PY
tar czf "$top/prefill_attention.tgz" -C "$top" prefill_attention && rm -rf "$out"
ls -la "$top"
