#!/usr/bin/env bash
# Every GPU figure issues 10 and 15 ask for, in one device call (the session's device time is short).
# Each step has its own time cap so one that hangs or fails cannot eat the others; every step's log
# lands in $OUT as it runs, so a call cut short still returns what it measured.
#
#   on the device (repo root, .whl carried):  bash bench/h200_session.sh
#   dry run here on the CPU, small layouts:   DRY=1 OUT=.bench-out/h200-dry bash bench/h200_session.sh
set -u
OUT=${OUT:-.bench-out/h200}
mkdir -p "$OUT"
if [ "${DRY:-0}" = "1" ]; then
    DEV=cpu MODEL=tiny LAYOUT=small; PY=${PY:-.venv/bin/python}
else
    DEV=cuda:0 MODEL=llama3-8b LAYOUT=llama3-8b; PY=python3
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
fi
$PY -c 'import platform, torch, transformers; print(platform.python_version(), torch.__version__, torch.version.cuda, transformers.__version__)' \
    > "$OUT/versions.txt" 2>&1
START=$(date +%s)

step() {  # step NAME LIMIT_S CMD...: run CMD with a cap, its output in $OUT/NAME.log, a summary here
    local name=$1 limit=$2 s rc
    shift 2
    s=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - s )) s (cap ${limit} s; $(( $(date +%s) - START )) s since start)"
    grep -v '^{' "$OUT/$name.log" | tail -n "${TAIL:-18}" | cut -c1-400
}

# the GPU-only branches of stage-while-verify (CUDA staging copy, finite scan, canary on IPC memory)
step stage_smoke 45 $PY -m bench.stage_smoke --device "$DEV"
# the whole path (issue 15's one measure): 8B, both transports, 5 updates each, bad versions rejected
TAIL=40 step gpu_e2e 310 $PY -m bench.gpu_e2e --model "$MODEL" --device "$DEV" --transports ipc,disk --updates 5 \
    --warmup 1 --health-window 0.5 --budget-s 140 --start-timeout 150 --update-timeout 60 --keep-logs --out "$OUT"
# the micro-benchmarks on the same machine: ipc copy (coalesced vs per tensor), disk reload with/without check
step ipc_update 75 $PY -m bench.ipc_update --layout "$LAYOUT" --device "$DEV" --updates 20 --check off --no-anchors \
    --out "$OUT"
step disk_reload_check 70 $PY -m bench.disk_reload --layout "$LAYOUT" --device "$DEV" --check both --repeats 3 \
    --sweep '' --skip-cold --check-sweep 16x32x3x4,16x32x4x16 --worker-path --out "$OUT/disk_reload_check.json"
# issue 10: admin and /health latency while a 16 GB update is on the same GPU
step admin_latency 45 $PY -m bench.admin_latency --device "$DEV" --out "$OUT/admin_latency.json"
echo "== all steps done in $(( $(date +%s) - START )) s"
