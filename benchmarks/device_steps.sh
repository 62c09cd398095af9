# Shared by the device-session scripts (sourced, not run): every step of a session has its own
# time limit, so one hang cannot eat the call, and its output goes to a log beside the JSON.
#   logs=DIR; . benchmarks/device_steps.sh
#   install_stack            # carried wheels (.whl/, if any) on PYTHONPATH, then this repo
#   step NAME SECONDS CMD... # run with a limit -> $logs/NAME.log; say how it ended (first
#                            # waiting for the GPUs to be free of the last step's processes)
#   gpu_tests SECONDS TESTS  # after gpu_session: the step "tests", pytest TESTS, its verdicts
install_stack() {  # once per call: suites started from one script share the install
    [ -n "${LLM_STACK_INSTALLED:-}" ] && return 0
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$logs/install.log" 2>&1 \
        || { cat "$logs/install.log"; exit 1; }
    export LLM_STACK_INSTALLED=1
}

gpus_idle() {  # a killed step's processes may still be freeing their GPU memory: wait <= 30 s
    # (only this step's GPUs: CUDA_VISIBLE_DEVICES, when set, as when suites share a machine)
    local i ids=(${CUDA_VISIBLE_DEVICES:+-i "$CUDA_VISIBLE_DEVICES"})
    for i in $(seq 30); do
        [ -z "$(nvidia-smi "${ids[@]}" --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] \
            && return
        sleep 1
    done
    echo "== GPUs still busy after 30 s:"
    nvidia-smi "${ids[@]}" --query-compute-apps=pid,used_memory --format=csv
}

step() {
    local name=$1 limit=$2; shift 2
    command -v nvidia-smi >/dev/null && gpus_idle
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (TIMED OUT)')"
    [ $rc = 0 ] || tail -"${STEP_TAIL:-4}" "$logs/$name.log"
    return 0
}

maybe() {  # maybe NAME LIMIT CMD...: step, if named in ONLY (when set) and its limit fits in
    # what is left of TOTAL_S (default 560: the device's 600 s a call); else say it was skipped
    local left=$(( ${TOTAL_S:-560} - SECONDS ))
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]]; then return 0; fi
    if [ "$2" -gt "$left" ]; then echo "== $1: SKIPPED ($2 s limit, $left s left)"; return 0; fi
    step "$@"
}

gpu_session() {  # gpu_session MARK: the start every multi-GPU script shares, after out=DIR and
    # logs=DIR: NVLink-multicast off (the device machines' rule), install, $gpus, env.txt, and
    # $T, the pytest command line for tests marked MARK (each prints its own diagnosis: -s;
    # thread timeouts give stacks even from inside a CUDA call)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONUNBUFFERED=1 LLM_STACK_MODELS=$PWD/models LLM_STACK_CACHE=/tmp/llm-stack-cache
    install_stack
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    gpus=$(nvidia-smi -L | wc -l)
    { nvidia-smi -L
      python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
      git log --oneline -1 2>/dev/null; date -u; } 2>&1 | tee "$out/env.txt"
    T="python3 -m pytest -v -s -m '$1' -p no:cacheprovider -o addopts= -rA --durations=8 --timeout 100 --timeout-method=thread"
}

verdicts() {  # verdicts NAME [N]: the last N (10) pass/fail lines of step NAME's pytest log
    grep -sE "^(PASSED|FAILED|ERROR)|passed|failed|Timeout" "$logs/$1.log" | tail -"${2:-10}"
}

gpu_tests() {  # gpu_tests LIMIT TESTS: the step "tests" (maybe), $T over TESTS (one string, split
    # by bash as a command line: quote a test id with brackets), then its verdicts
    maybe tests "$1" bash -c "$T $2"
    verdicts tests 12
}
