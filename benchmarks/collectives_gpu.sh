#!/usr/bin/env bash
# Layer 2 on the GPU machine in one call: install, the multi-GPU tests, the sweep
# (ours vs torch.distributed/NCCL, 8 B .. 1 GiB: busbw table and plot, alpha-beta fit and
# predicted-vs-measured plot, overlap demo), the tuning grid, and a compact summary last.
#
# Usage, from the repo root, on 2 or 4 GPUs (about 5 minutes on 2; each step has a time
# limit — tests 200 s, sweep 240 s, grid 130 s — so even a hang ends inside 10 minutes):
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 bash benchmarks/collectives_gpu.sh
# (those three are also the defaults here: NVLink multicast stays off.)
# Optional: L2_WORLD (ranks; default every GPU), L2_MAX_BYTES (default 1073741824),
#   L2_FACTOR (size step, 2), L2_ITERS (20), L2_TUNE_SIZES (67108864,268435456),
#   L2_SKIP_TESTS=1, L2_SKIP_TUNE=1, L2_SKIP_INSTALL=1, L2_BACKEND=gloo (no GPU: checks this
#   script's logic on a CPU with small sizes).
# Output in $OUT (default ./l2-out), five files (the device tool returns at most eight):
#   summary.txt, busbw.png, time_vs_size.png, pytest_multigpu.log, and l2_results.tgz
#   (bench.json/md, tune.json, every log, env.txt).
set -uo pipefail
out=${OUT:-l2-out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=$(mktemp -d)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} PYTHONUNBUFFERED=1 LLM_STACK_RESULTS="$work/results"
t0=$SECONDS
say() { echo "[l2 $((SECONDS - t0)) s] $*"; }

if [ -z "${L2_SKIP_INSTALL:-}" ]; then
    say "install"
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$work/install.log" 2>&1 \
        || { tail -20 "$work/install.log"; exit 1; }
fi
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
backend=${L2_BACKEND:-nccl}
[ "$gpus" -lt 2 ] && backend=gloo
if [ "$backend" = gloo ]; then world=${L2_WORLD:-2}; else world=${L2_WORLD:-$gpus}; fi
if [ "$backend" = gloo ]; then max=${L2_MAX_BYTES:-65536}; else max=${L2_MAX_BYTES:-1073741824}; fi
if [ "$backend" = gloo ]; then tune_sizes=${L2_TUNE_SIZES:-1048576}; else tune_sizes=${L2_TUNE_SIZES:-67108864,268435456}; fi
iters=${L2_ITERS:-20}; factor=${L2_FACTOR:-2}
{
    nvidia-smi 2>&1; nvidia-smi topo -m 2>&1
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
    env | grep -E '^(NCCL_|TORCH_SYMM|NVSHMEM|LLM_STACK_L2)' | sort
    echo "gpus=$gpus backend=$backend world=$world max=$max factor=$factor iters=$iters tune_sizes=$tune_sizes"
} >"$work/env.txt" 2>&1
say "$gpus GPU(s) visible: $world ranks on $backend"

if [ -z "${L2_SKIP_TESTS:-}" ]; then
    say "pytest -m multigpu tests/layer2"
    timeout -k 10 200 python3 -m pytest -m multigpu -q -p no:cacheprovider tests/layer2 \
        >"$out/pytest_multigpu.log" 2>&1
    echo "pytest exit code $?" >>"$out/pytest_multigpu.log"
    tail -4 "$out/pytest_multigpu.log"
fi

say "stack bench --layer 2 (8 B .. $max B)"
timeout -k 10 240 stack bench --layer 2 --world "$world" --backend "$backend" --max-bytes "$max" \
    --factor "$factor" --iters "$iters" --timeout 220 --out "$work/bench" >"$work/bench.log" 2>&1
say "bench exit code $?"

if [ -z "${L2_SKIP_TUNE:-}" ]; then
    say "tuning grid at $tune_sizes B"
    timeout -k 10 130 python3 -m layer2_comm.commands tune --world "$world" --backend "$backend" \
        --sizes "$tune_sizes" --timeout 110 --out "$work/bench" >"$work/tune.log" 2>&1
    say "tune exit code $?"
fi

for png in busbw.png time_vs_size.png; do
    [ -f "$work/bench/$png" ] && cp "$work/bench/$png" "$out/"
done
[ -f "$out/pytest_multigpu.log" ] && cp "$out/pytest_multigpu.log" "$work/"
python3 benchmarks/collectives_summary.py "$work/bench" "$out/pytest_multigpu.log" >"$work/summary.txt" 2>&1
cp "$work/summary.txt" "$out/summary.txt"
tar czf "$out/l2_results.tgz" -C "$work" --exclude results .
say "done; $out: $(cd "$out" && ls | tr '\n' ' ')"
# Last, so it is what the device tool's 12,000-character tail shows: the bench's own
# tables (ours vs built-in, alpha-beta), the tuning verdicts, then the summary.
tail -c 3500 "$work/bench.log"
[ -f "$work/tune.log" ] && grep -E "^(all_|reduce_|header)" "$work/tune.log"
cat "$out/summary.txt"
rm -rf "$work"
