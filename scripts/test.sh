#!/usr/bin/env bash
# Set up ./.venv with the dev extra if needed and run the test suite.
# Set HOTSWAP_TEST_POSTGRES_URL (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test) to run
# every database test against PostgreSQL too. Extra arguments go to pytest.
set -euo pipefail
. "$(dirname "$0")/_venv.sh"
ensure_venv "[dev]"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
