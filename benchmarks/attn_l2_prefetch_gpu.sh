#!/usr/bin/env bash
# Decode batch 1, the attention launch's extra programs asking the L2 for each layer's
# first gate_up MB while attention leaves HBM idle (LLM_STACK_ATTN_L2_PREFETCH_MB, off by
# default). One GPU (Hopper), < 200 s incl. install and Triton compiles.
# Run from the repo root:  bash benchmarks/attn_l2_prefetch_gpu.sh   (carry .whl)
# Read: pytest_gpu must pass (on == off bit for bit); profile.log "attn l2 prefetch N MB: best ..., MBU"
# for 0 / 8 / 16 / 24 MB, every trial "first 256 of 256 tokens". Flip the default (layer 3
# backends.ATTN_L2_PREFETCH_BYTES) only if both runs of a setting beat both 0-MB runs by more than
# their spread and the profile shows gate_up faster without attention / o_proj slower as much.
set -uo pipefail
top=${OUT:-gpu-out}; out=$top/attn_l2_prefetch; mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLM_STACK_RESULTS=$out/results LLM_STACK_CACHE=/tmp/llm-stack-cache
export TOTAL_S=195
logs=$out; . benchmarks/device_steps.sh
install_stack
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; } \
    2>&1 | tee "$out/env.txt"
# 1. on == off bit for bit: the fused decode step replayed from a CUDA graph (256 KB and 16 KB
#    slices), and layer 1's launch with the extra programs (+ today's paged decode GPU tests)
maybe pytest_gpu 70 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts= -rfEs \
    --timeout 60 --durations=5 tests/layer3/test_attn_l2_prefetch.py \
    tests/layer3/test_fused_decode.py -k "l2_prefetch or under_cuda_graph"
tail -6 "$out/pytest_gpu.log"
# 2. decode 1B batch 1 (step_greedy, graph replay, PDL, layer 3's attention config): prefetch
#    0 / 8 / 16 / 24 MB a layer, twice interleaved; greedy tokens must match; then the profile
#    of the fastest
maybe profile 70 python3 benchmarks/profile_decode.py --no-profile --attn-l2-prefetch-trials \
    --attn-l2-prefetch-mb 0,8,16,24 --profile-best --json "$out/profile_decode.json"
grep -E "^attn l2|DIFFER|FAILED" "$out/profile.log" | head -20
# 3. (if time is left) the same at 64 KB a program (4x the programs): 0 / 16 MB
maybe slices 45 python3 benchmarks/profile_decode.py --no-profile --attn-l2-prefetch-trials \
    --attn-l2-prefetch-mb 0,16 --attn-l2-slice-kb 64 --json "$out/profile_slices.json"
grep -E "^attn l2.*best|DIFFER|FAILED" "$out/slices.log" 2>/dev/null
grep -hE "^attn l2.*best" "$out/profile.log" "$out/slices.log" 2>/dev/null > "$top/summary.txt"
tar czf "$top/attn_l2_prefetch.tgz" -C "$top" attn_l2_prefetch && rm -rf "$out"
ls -la "$top"
