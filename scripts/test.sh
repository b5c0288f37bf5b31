#!/usr/bin/env bash
# Set up ./.venv with the dev extra if needed and run the test suite.
# Set HOTSWAP_TEST_POSTGRES_URL (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test) to run
# every database test against PostgreSQL too. Extra arguments go to pytest.
#
# With no test path among the arguments (the whole suite, the quick tier with `-m quick`), pytest
# runs on HOTSWAP_TEST_WORKERS processes (pytest-xdist, default 3: most tests wait on processes
# they started, so three keep two cores busy); each test module runs whole in one of them
# (tests/conftest.py). A path argument (a file you are working on) runs in this process, as does
# HOTSWAP_TEST_WORKERS=0.
set -euo pipefail
. "$(dirname "$0")/_venv.sh"
ensure_venv "[dev]"
cd "$ROOT"
workers="${HOTSWAP_TEST_WORKERS:-3}"
for arg in "$@"; do
    case "$arg" in
        -n|-n*|--numprocesses*|-pno:xdist) workers=0 ;;  # the caller chose
        -*) ;;
        *) [ -e "${arg%%::*}" ] && workers=0 ;;          # a test path: run it here
    esac
done
parallel=()
[ "$workers" != "0" ] && parallel=(-n "$workers")
exec "$VENV/bin/python" -m pytest "${parallel[@]}" "$@"
