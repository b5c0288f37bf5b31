#!/usr/bin/env bash
# The models and the migrations agree: migrate a fresh SQLite database and (when given a server
# URL) a fresh PostgreSQL database with `hotswap db upgrade`, then `alembic check` each.
#   ./scripts/check-migrations.sh [postgresql+psycopg://postgres@127.0.0.1:5432/test]
set -euo pipefail
. "$(dirname "$0")/_venv.sh"
ensure_venv "[dev]"
cd "$ROOT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
check() {  # NAME URL: fails (exit 1) naming each difference
    printf '[daemon]\nstate_dir = "%s"\n[database]\nurl = "%s"\n' "$WORK/state" "$2" > "$WORK/c.toml"
    "$VENV/bin/hotswap" db upgrade -c "$WORK/c.toml" >/dev/null
    if ! out="$("$VENV/bin/alembic" -c "$ROOT/alembic.ini" -x "url=$2" check 2>&1)"; then
        echo "check-migrations: $1: the models and the migrations disagree:" >&2
        echo "$out" >&2
        exit 1
    fi
    echo "$1: $(tail -n 1 <<<"$out")"
}
check sqlite "sqlite:///$WORK/registry.db"
pg() {  # SERVER_URL create|drop DB
    "$VENV/bin/python" -c 'import sys; from sqlalchemy import create_engine, text
with create_engine(sys.argv[1] + "/postgres", isolation_level="AUTOCOMMIT").connect() as c:
    c.execute(text(("CREATE" if sys.argv[2] == "create" else "DROP") + " DATABASE \"" + sys.argv[3] + "\""))' "$@"
}
if [ -n "${1:-}" ]; then
    server="${1%/*}"
    db="hotswap_check_$$"
    pg "$server" create "$db"
    trap 'pg "$server" drop "$db" || true; rm -rf "$WORK"' EXIT
    check postgresql "$server/$db"
fi
