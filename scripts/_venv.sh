# Sourced by run-daemon.sh and test.sh: make ./.venv with torch 2.13.0 and hotswap installed.
# Idempotent and fast on a second run: a stamp file records what was installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
TORCH_VERSION="2.13.0"

ensure_venv() {
    local extra="$1"   # "" or "[dev]"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "creating $VENV with $($PY --version)" >&2
        "$PY" -m venv "$VENV"
    fi
    local stamp="$VENV/.hotswap-installed$extra"
    local want
    want="torch=$TORCH_VERSION $(sha1sum "$ROOT/pyproject.toml" | cut -c1-12)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
        # Installed first and pinned, so `pip install -e .` (torch range) keeps it. Set
        # TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the small CPU build elsewhere.
        echo "installing torch==$TORCH_VERSION" >&2
        "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
    echo "installing hotswap (pip install -e .$extra)" >&2
    "$VENV/bin/python" -m pip install -q -e "$ROOT$extra"
    echo "$want" > "$stamp"
}
