#!/usr/bin/env bash
# One device call: train course-model variants side by side on one GPU (they are far too
# small to fill it), pack them for the trip back, then run any GPU tests given as arguments.
#   bash benchmarks/train_course_models.sh [PYTEST_ARGS...]
# Needs build/course-data (carry it): see layer3_model/training/train.py for how it is prepared.
# Each line of $VARIANTS is "NAME SIZE TRAIN-ARGS..."; the chosen ones get committed to models/.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
models=/tmp/course-models; mkdir -p $models
VARIANTS=${VARIANTS:-"target target --steps 1000 --lr 1e-3 --dropout 0.2
draft draft --steps 1200 --lr 2e-3 --dropout 0.1"}
while read -r name size args; do
    # shellcheck disable=SC2086
    python3 -m layer3_model.training.train --size "$size" --data build/course-data --out "$models/$name" \
        --ckpt "/tmp/$name.ckpt.pt" --batch 32 --seq 512 --eval-every 100 --eval-batches 8 \
        --max-minutes 5 $args >"$models/$name.log" 2>&1 &
done <<<"$VARIANTS"
if [ $# -gt 0 ]; then python3 -m pytest -m gpu -q -p no:cacheprovider "$@" >"$out/pytest_gpu.log" 2>&1; echo "pytest exit $?"; tail -15 "$out/pytest_gpu.log"; fi
wait
for f in $models/*.log; do echo "== $f"; grep -E "parameters|best val" "$f"; done | tee "$out/summary.txt"
# the tool brings back files of at most 16 MiB: split the archive (cat models.tgz.* | tar xz)
tar czf - -C $models . | split -b 15M - "$out/models.tgz."
