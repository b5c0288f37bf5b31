#!/usr/bin/env bash
# Issue 41's GPU figures in one device call (the session's device time is short). Each step has its own
# time cap so one that hangs or fails cannot eat the others; every step's log lands in $OUT as it runs.
# The caps add up to 545 s (plus ~15 s of set-up): one device call of 600 s holds the whole session.
# Only 8 files come back from a device call: at the end everything is packed into session.tar.gz, beside
# table.md and session.txt (this script's own output).
#
#   on the device (repo root, .whl carried):  bash bench/h200_session.sh
#   .whl (here, once): the project's Python 3.12 wheels that the device's image lacks, pinned to this
#   venv's versions (FastAPI >= 0.16x imports opentelemetry: carry opentelemetry-api with it, or the
#   workers die at import, as on 2026-12-05 04:35):
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       crc32c blake3 zstandard sqlalchemy greenlet alembic mako watchdog "apscheduler<4" tzlocal structlog \
#       cryptography cffi pycparser boto3 botocore s3transfer jmespath annotated-types typing-inspection \
#       annotated-doc opentelemetry-api typing_extensions \
#       $(.venv/bin/pip list --format=freeze | grep -iE '^(fastapi|starlette|pydantic|pydantic.core|uvicorn)==')
#   dry run here on the CPU, small layouts:   DRY=1 OUT=.bench-out/h200-dry bash bench/h200_session.sh
#
# REBUILD=1 times the 8B delta rebuild into fresh files and over a stale version's (bench/delta_rebuild_ab.py).
# ONE_READ=1 first times the verify pass's one read alone over a sweep of threads x chunk (bench/one_read.py).
# ALL_AT_ONCE=1 runs the end-to-end step again with both workers in one batch (max_unavailable = 2).
# TRANSPORTS=ipc (default ipc,disk) runs the end-to-end step on one transport only. UPDATE_MODE=swap runs
# it in swap mode (the workers point at the loader's buffers: 8B needs more than an H100's 80 GB).
# Writes under $OUT: versions.txt, gpu.txt, wheels.txt (what was installed, or why not), a NAME.log per
# step, gpu_e2e-<layout>.json (both transports, 5 measured updates each, bad versions, the flip-back),
# ipc_update-<layout>.json (ipc copy / swap micro + checkpoint-engine's update() anchor),
# disk_reload_check.json (ours from host memory, digests checked and not), table.md (issue 41's tables),
# all of it packed into session.tar.gz at the end (table.md and session.txt stay beside it).
set -u
OUT=${OUT:-.bench-out/h200}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.txt") 2>&1
if [ "${DRY:-0}" = "1" ]; then
    DEV=cpu MODEL=tiny LAYOUT=small; PY=${PY:-.venv/bin/python}; UPDATES=${UPDATES:-2}; MICRO=3
    echo "dry run: nothing installed" > "$OUT/wheels.txt"
else
    DEV=cuda:0 MODEL=llama3-8b LAYOUT=llama3-8b; PY=python3; UPDATES=${UPDATES:-5}; MICRO=${MICRO:-20}
    # the project's dependencies (carried in .whl/, as before), then checkpoint-engine 0.4.2 and what it
    # needs beyond them (bench/wheels/, in the tree) into a second target: a clash there never stops ours
    if ls .whl/*.whl > /dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { echo "wheel install failed"; exit 1; }
    fi
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-anchor \
        bench/wheels/*.whl > "$OUT/wheels.txt" 2>&1 || echo "checkpoint-engine wheels: install failed" >> "$OUT/wheels.txt"
    export PYTHONPATH=/tmp/site:$PWD:/tmp/site-anchor
    $PY -c 'import checkpoint_engine.ps, zmq, loguru; print("checkpoint-engine importable")' >> "$OUT/wheels.txt" 2>&1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
fi
$PY -c 'import platform, torch, transformers; print(platform.python_version(), torch.__version__, torch.version.cuda, transformers.__version__)' \
    > "$OUT/versions.txt" 2>&1
START=$(date +%s)

step() {  # step NAME LIMIT_S CMD...: run CMD with a cap, its output in $OUT/NAME.log, a summary here
    local name=$1 limit=$2 s rc
    shift 2
    case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped (SKIP)"; return;; esac
    s=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - s )) s (cap ${limit} s; $(( $(date +%s) - START )) s since start)"
    grep -v '^{' "$OUT/$name.log" | grep -v '| INFO ' | tail -n "${TAIL:-18}" | cut -c1-400
}

# the verify pass's one read alone (ONE_READ=1): reader threads x chunk size, staged and hash only
if [ "${ONE_READ:-0}" = "1" ]; then
    step one_read "${ONE_READ_CAP:-120}" $PY -m bench.one_read --layout "$LAYOUT" --device "$DEV" --out "$OUT/one_read.json" \
        $( [ "$DEV" = cpu ] && echo --sweep 2x8,2x2 --repeats 2 )
fi
# the GPU-only branches of stage-while-verify (CUDA staging copy, finite scan, canary on IPC memory)
step stage_smoke 40 $PY -m bench.stage_smoke --device "$DEV"
# the whole path: 8B, both transports, 5 updates each under load, bad versions rejected before any pause,
# then (ipc) the flip-back after a probe that fails after resume, on w0 with the daemon stopped
TAIL=45 step gpu_e2e "${E2E_CAP:-310}" $PY -m bench.gpu_e2e --model "$MODEL" --device "$DEV" --transports "${TRANSPORTS:-ipc,disk}" \
    --updates "$UPDATES" --warmup 1 --health-window 0.5 --budget-s "${E2E_BUDGET:-140}" --start-timeout 150 --update-timeout 60 \
    --flip-back 3 --keep-logs --out "$OUT" --delta-updates "${DELTA_UPDATES:-0}" --delta-in ipc \
    --update-mode "${UPDATE_MODE:-copy}"
# ALL_AT_ONCE=1: the same, both workers in one batch ([rollout] max_unavailable = 2), no bad versions
if [ "${ALL_AT_ONCE:-0}" = "1" ]; then
    mkdir -p "$OUT/all-at-once"
    TAIL=30 step gpu_e2e_all_at_once "${E2E2_CAP:-200}" $PY -m bench.gpu_e2e --model "$MODEL" --device "$DEV" \
        --transports "${TRANSPORTS:-ipc,disk}" --updates "$UPDATES" --warmup 1 --health-window 0.5 \
        --budget-s "${E2E2_BUDGET:-100}" --start-timeout 150 --update-timeout 60 --reject '' --flip-back 0 \
        --max-unavailable 2 --out "$OUT/all-at-once" --update-mode "${UPDATE_MODE:-copy}"
fi
# micro-benchmarks on the same machine: ipc copy and swap, and the anchors in the same process:
# checkpoint-engine's update() from host memory into the GPU (register_checkpoint not counted)
step ipc_update "${IPC_CAP:-130}" $PY -m bench.ipc_update --layout "$LAYOUT" --device "$DEV" --updates "$MICRO" --check off --out "$OUT"
rm -rf /tmp/hotswap-ipc-bench  # its two 16 GB versions: the delta step needs the room on a 64 GB disk
# ours from host memory (page cache) into the GPU: no checks, and with the digests checked
step disk_reload_check 65 $PY -m bench.disk_reload --layout "$LAYOUT" --device "$DEV" --check both --repeats 3 \
    --sweep '' --skip-cold --check-sweep 16x32x3x4 --worker-path --out "$OUT/disk_reload_check.json"
# issue 38 on the same host, when asked (REBUILD=1): the 8B rebuild of one 1 %-density delta, into fresh
# files and over a stale rebuilt version's files (`[daemon] recycle_rebuilt`), alternating, each + verify
if [ "${REBUILD:-0}" = "1" ]; then
    RBW_ROOT=/tmp/rbw RBW_DEVICE="$( [ "$DEV" = cpu ] && echo cpu || echo cuda )" step delta_rebuild "${REBUILD_CAP:-150}" \
        $PY -m bench.delta_rebuild_ab "$LAYOUT" "${REBUILD_PAIRS:-3}" --recycle \
        --json "$OUT/recycle-ab-$LAYOUT.json"
    rm -rf /tmp/rbw
fi
# issue 38 on the same host, when asked (DELTA_LAYOUT=1): the 8B layout's deltas, 1 % density first
# (saved after each density: the cap keeps what was measured)
if [ "${DELTA_LAYOUT:-0}" = "1" ]; then
    step delta_layout "${DELTA_CAP:-90}" $PY -m bench.delta --layout "$LAYOUT" $( [ "$DEV" != cpu ] && echo --gpu "$DEV" ) \
        --densities 0.01,0.001,0.05,0.3,1.0 --out "$OUT/delta-$LAYOUT.json"
fi
$PY -m bench.h200_table "$OUT" > "$OUT/table.md" 2>&1
if [ -d "$OUT/all-at-once" ]; then
    { echo; echo "#### both workers at once (max_unavailable = 2)"; $PY -m bench.h200_table "$OUT/all-at-once"; } >> "$OUT/table.md" 2>&1
fi
cat "$OUT/table.md"
echo "== all steps done in $(( $(date +%s) - START )) s"
# pack: at most 8 files come back from the device machine
tar -czf "/tmp/session.tar.gz" -C "$OUT" --exclude session.txt . && mv /tmp/session.tar.gz "$OUT/session.tar.gz" \
    && find "$OUT" -mindepth 1 -not -name session.tar.gz -not -name table.md -not -name session.txt -delete
