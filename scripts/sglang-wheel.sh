#!/usr/bin/env bash
# Print the path of the sglang==$SGLANG_VERSION wheel, downloading it (without its dependencies and
# without installing it) once per machine into ${XDG_CACHE_HOME:-~/.cache}/hotswap/. The tests read
# SGLang's own http_server.py and io_struct.py out of it; nothing of it is ever imported or run.
#
#   HOTSWAP_SGLANG_WHEEL=/x/sglang-0.5.23-py3-none-any.whl   # use that file instead
set -euo pipefail
SGLANG_VERSION="0.5.23"

if [ -n "${HOTSWAP_SGLANG_WHEEL:-}" ]; then
    echo "$HOTSWAP_SGLANG_WHEEL"
    exit 0
fi

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
DEST="${XDG_CACHE_HOME:-$HOME/.cache}/hotswap/sglang-$SGLANG_VERSION"
find_wheel() { ls "$DEST"/sglang-"$SGLANG_VERSION"-*.whl 2>/dev/null | head -n1; }

wheel="$(find_wheel || true)"
if [ -z "$wheel" ]; then
    mkdir -p "$(dirname "$DEST")"
    tmp="$(mktemp -d "$DEST.tmp-XXXXXX")"
    echo "sglang-wheel: downloading sglang==$SGLANG_VERSION (no deps, not installed)" >&2
    "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$tmp" "sglang==$SGLANG_VERSION" >&2
    # Publish by rename so a half-downloaded wheel is never found (a concurrent run may have won).
    mv -T "$tmp" "$DEST" 2>/dev/null || rm -rf "$tmp"
    wheel="$(find_wheel)"
fi
echo "$wheel"
