#!/usr/bin/env bash
# Two trees measured back to back in one device call, so a change's figure has its baseline from the
# same warm machine: this tree ("new"), then the tree in .bench-out/base ("base"), each through
# bench/h200_session.sh with the same settings. Output under $OUT/new and $OUT/base.
#
#   here, once:  rm -rf .bench-out/base && mkdir -p .bench-out/base && git archive BASE | tar -x -C .bench-out/base
#                cp bench/gpu_e2e.py bench/loadgen.py .bench-out/base/bench/   # the same harness in both
#   device (carry .whl and .bench-out/base):  TRANSPORTS=disk bash bench/h200_ab.sh
# TRANSPORTS (default disk), UPDATE_MODE (copy), CAP (each tree's gpu_e2e cap, 250 s) and BUDGET (110 s)
# pass through; the micro-benchmarks are skipped (they measure the hardware, not the tree).
set -u
OUT=$(mkdir -p "${OUT:-.bench-out/ab}" && cd "${OUT:-.bench-out/ab}" && pwd)
[ -d .bench-out/base/bench ] || { echo "no .bench-out/base: see the header" >&2; exit 2; }
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
fi
run() {  # run NAME: this directory's tree through the session script
    OUT=$OUT/$1 PYTHONUNBUFFERED=1 UPDATE_MODE=${UPDATE_MODE:-copy} TRANSPORTS=${TRANSPORTS:-disk} \
        SKIP="stage_smoke disk_reload_check ipc_update" E2E_CAP=${CAP:-250} E2E_BUDGET=${BUDGET:-110} \
        bash bench/h200_session.sh 2>&1 | grep -E "^==|commit -> both|start \(|pause window|one read|forward|failed /"
}
run new
(cd .bench-out/base && run base)
