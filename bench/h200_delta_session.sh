#!/usr/bin/env bash
# Issue 38's GPU figures in one device call (a second call beside bench/h200_session.sh, whose steps
# fill their own 600 s): the 8B layout's deltas (bytes, encode, rebuild + verify, GPU apply) and
# commit -> both serving for 1 %-density delta versions beside full ones in the same fleet; then the
# CUDA-only tests of the suite. Caps add up to 560 s.
#
#   on the device (repo root, .whl carried):  bash bench/h200_delta_session.sh
#   dry run here on the CPU, small layouts:   DRY=1 OUT=.bench-out/h200-delta-dry bash bench/h200_delta_session.sh
set -u
OUT=${OUT:-.bench-out/h200-delta}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.txt") 2>&1
if [ "${DRY:-0}" = "1" ]; then
    DEV=cpu MODEL=tiny LAYOUT=small GPU=""; PY=${PY:-.venv/bin/python}
else
    DEV=cuda:0 MODEL=llama3-8b LAYOUT=llama3-8b GPU="--gpu cuda:0"; PY=python3
    if ls .whl/*.whl > /dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { echo "wheel install failed"; exit 1; }
    fi
    export PYTHONPATH=/tmp/site:$PWD
fi
START=$(date +%s)
step() {  # step NAME LIMIT_S CMD...: as in bench/h200_session.sh
    local name=$1 limit=$2 s rc
    shift 2
    s=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - s )) s (cap ${limit} s; $(( $(date +%s) - START )) s since start)"
    grep -v '^{"event' "$OUT/$name.log" | grep -v '| INFO ' | tail -n "${TAIL:-18}" | cut -c1-400
}
# 8B, bf16: 1 % first (the figure the issue gates on), then the other densities
step delta_layout 250 $PY -m bench.delta --layout "$LAYOUT" $GPU --densities 0.01,0.001,0.05,0.3,1.0 \
    --out "$OUT/delta-$LAYOUT.json"
# one fleet (ipc), full versions then 1 %-density delta versions, under load, every check on
TAIL=30 step gpu_e2e_delta 240 $PY -m bench.gpu_e2e --model "$MODEL" --device "$DEV" --transports ipc \
    --updates 3 --warmup 1 --delta-updates 3 --delta-density 0.01 --health-window 0.5 --budget-s 200 \
    --start-timeout 120 --update-timeout 60 --flip-back 0 --reject '' --out "$OUT"
if [ "${DRY:-0}" != "1" ]; then  # the tests that skip without CUDA (22 in the suite)
    step cuda_tests 60 $PY -m pytest -q -p no:cacheprovider -p no:randomly -x tests/checks/test_stage_verify.py \
        tests/transport/test_stage_verify_loader.py tests/transport/test_ipc_cuda.py tests/transport/test_transport_disk.py \
        tests/worker/test_worker_engine.py
fi
$PY -m bench.h200_table "$OUT" > "$OUT/table.md" 2>&1
cat "$OUT/table.md"
echo "== all steps done in $(( $(date +%s) - START )) s"
tar -czf "/tmp/session.tar.gz" -C "$OUT" --exclude session.txt . && mv /tmp/session.tar.gz "$OUT/session.tar.gz" \
    && find "$OUT" -mindepth 1 -not -name session.tar.gz -not -name table.md -not -name session.txt -delete
