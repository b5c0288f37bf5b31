#!/usr/bin/env bash
# Quickstart: set up ./.venv if needed and run the daemon on the embedded default config
# (SQLite in ./state/hotswap.db, watching ./checkpoints, API on 127.0.0.1:8780).
# Extra arguments go to `hotswap daemon` (e.g. -c config.toml).
set -euo pipefail
. "$(dirname "$0")/_venv.sh"
ensure_venv ""
cd "$ROOT"
exec "$VENV/bin/hotswap" daemon "$@"
