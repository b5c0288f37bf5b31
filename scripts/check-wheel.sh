#!/usr/bin/env bash
# Build the wheel from the working tree's files, install it (non-editable, torch 2.13.0 first) into
# a venv outside the repository, and start `hotswap daemon` from an empty folder: it must migrate
# its database, answer /health, launch its managed reference worker from the installed package
# (seed checkpoint + tokenizer made locally) and serve a text completion; then stop it.
#
# The venv holding the third-party dependencies is cached, keyed by the Python version, the torch
# version and the wheel's own Requires-Dist lines (a changed dependency builds a new one); hotswap
# itself is reinstalled from the new wheel every run and `pip check` verifies the set.
# HOTSWAP_WHEEL_FRESH=1 builds the venv from scratch in a temp dir instead.
set -euo pipefail
. "$(dirname "$0")/_venv.sh"
ensure_venv "[dev]"   # only its pip builds the wheel; nothing of the repository's venv is installed
T0=$(date +%s)
WORK="$(mktemp -d -t hotswap-wheel.XXXXXX)"
DAEMON_PID=""
cleanup() {
    if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
        kill -TERM "$DAEMON_PID" 2>/dev/null || true
        sleep 3
        kill -KILL "$DAEMON_PID" 2>/dev/null || true
    fi
    if [ -f "$WORK/state/worker-w0.json" ]; then  # never leave the managed worker behind
        kill -KILL "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$WORK/state/worker-w0.json")" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
say() { echo "check-wheel: $*" >&2; }
fail() { say "FAIL: $*"; [ -f "$WORK/daemon.log" ] && tail -n 40 "$WORK/daemon.log" >&2; exit 1; }

# 1. wheel, from the files git would ship (tracked + untracked-not-ignored), never stale build/ dirs
mkdir -p "$WORK/src" "$WORK/dist"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$WORK/src")
# The repository venv's setuptools builds it when new enough (saves the isolated build env's ~8 s)
ISOLATION=""
"$VENV/bin/python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
    2>/dev/null && ISOLATION="--no-build-isolation"
"$VENV/bin/python" -m pip wheel -q --no-deps $ISOLATION -w "$WORK/dist" "$WORK/src" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
WHEEL="$(ls "$WORK"/dist/hotswap-*.whl 2>/dev/null | head -n1)"
[ -n "$WHEEL" ] || fail "no wheel was built"
LISTING="$("$PY" -m zipfile -l "$WHEEL")"
for f in daemon/migrations/env.py daemon/migrations/script.py.mako daemon/migrations/versions/0001_initial.py; do
    grep -q "^$f " <<<"$LISTING" || fail "$f is not in the wheel"
done
T_BUILD=$(date +%s)

# 2. venv: torch 2.13.0 first (from local disk), then the wheel and its dependencies
REQS="$("$PY" - "$WHEEL" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    print("\n".join(sorted(l for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:"))))
EOF
)"
KEY="$(printf '%s\n%s\n%s\n' "$("$PY" --version)" "$TORCH_VERSION" "$REQS" | sha1sum | cut -c1-12)"
if [ "${HOTSWAP_WHEEL_FRESH:-0}" = 1 ]; then
    WVENV="$WORK/venv"
else
    CACHE="${HOTSWAP_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hotswap-ci}"
    WVENV="$CACHE/wheel-venv-$KEY"
    mkdir -p "$CACHE"
fi
# pip's own exit status (an install that failed or was killed must never be marked complete),
# its output without the offline mirror's "Location ... is ignored" warnings
install_quiet() {
    local rc=0
    "$WVENV/bin/python" -m pip install -q "$@" >"$WORK/pip.log" 2>&1 || rc=$?
    grep -v "^WARNING: Location" "$WORK/pip.log" >&2 || true
    return "$rc"
}
if [ ! -f "$WVENV/.complete" ]; then
    say "building the dependency venv $WVENV (once per dependency set)"
    rm -rf "$WVENV"
    "$PY" -m venv "$WVENV"
    install_quiet "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
        || fail "installing torch $TORCH_VERSION into $WVENV"
    install_quiet "$WHEEL" || fail "installing the wheel and its dependencies into $WVENV"
    touch "$WVENV/.complete"
else
    install_quiet --no-deps --force-reinstall "$WHEEL" || fail "reinstalling the wheel into $WVENV"
fi
# a cached venv that no longer checks out is built again by the next run
"$WVENV/bin/python" -m pip check >/dev/null 2>&1 \
    || { "$WVENV/bin/python" -m pip check >&2; rm -f "$WVENV/.complete"; fail "pip check"; }
"$WVENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
    || fail "torch in the venv is not $TORCH_VERSION"
cd "$WORK"   # from here on nothing may find the repository's files (python -c puts . on sys.path)
WHERE="$(env -u PYTHONPATH "$WVENV/bin/python" -c 'import daemon; print(daemon.__file__)')"
case "$WHERE" in "$ROOT"/*) fail "daemon is imported from the repository ($WHERE), not the wheel";; esac
VERSION_LINE="$(env -u PYTHONPATH "$WVENV/bin/hotswap" --version)"
T_INSTALL=$(date +%s)

# 3. the daemon from an empty folder: migrate, /health, managed worker serving text
mkdir -p "$WORK/run"
cat > "$WORK/config.toml" <<EOF
[daemon]
state_dir = "$WORK/state"
listen = "127.0.0.1:0"
keep_workers_on_stop = false  # the check leaves nothing running behind it

[[sources]]
path = "$WORK/checkpoints"

[[workers]]
name = "w0"
launch = "managed"
device = "cpu"
EOF
(cd "$WORK/run" && exec env -u PYTHONPATH OMP_NUM_THREADS=1 "$WVENV/bin/hotswap" daemon -c "$WORK/config.toml") \
    >"$WORK/daemon.log" 2>&1 &
DAEMON_PID=$!
env -u PYTHONPATH "$WVENV/bin/python" - "$WORK" "$DAEMON_PID" <<'EOF' || fail "the installed daemon did not come up (log below)"
import json, os, sys, time
from pathlib import Path
import httpx

work, pid = Path(sys.argv[1]), int(sys.argv[2])
deadline = time.monotonic() + 180

def alive() -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False

def wait(what, fn):
    while time.monotonic() < deadline:
        if not alive():
            sys.exit(f"daemon exited while waiting for {what}")
        try:
            v = fn()
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            v = None
        if v:
            return v
        time.sleep(0.2)
    sys.exit(f"timed out waiting for {what}")

api = wait("daemon.json", lambda: json.loads((work / "state" / "daemon.json").read_text())["api_url"])
wait("/health 200", lambda: httpx.get(f"{api}/health", timeout=5).status_code == 200)
port = wait("the managed worker", lambda: json.loads((work / "state" / "worker-w0.json").read_text())["port"])
url = f"http://127.0.0.1:{port}"
wait("the worker /ready", lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 200)
r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello, wörld", "max_tokens": 4, "temperature": 0},
               timeout=60)
assert r.status_code == 200, r.text
doc = r.json()
assert isinstance(doc["choices"][0]["text"], str) and doc["weight_version"], doc
assert not (work / "run" / "state").exists(), "the daemon wrote state into its working folder"
print(f"check-wheel: daemon {api} healthy; worker {url} served {doc['model']!r} {doc['weight_version']}",
      file=sys.stderr)
EOF
CURRENT="$(cd "$WORK/run" && env -u PYTHONPATH "$WVENV/bin/hotswap" db current -c "$WORK/config.toml")"
HEAD="$(env -u PYTHONPATH "$WVENV/bin/python" -c '
from alembic.script import ScriptDirectory
from daemon.registry.db import alembic_config
print(ScriptDirectory.from_config(alembic_config()).get_current_head())')"
[ "$CURRENT" = "$HEAD" ] || fail "database at revision $CURRENT, the package's head is $HEAD"
kill -TERM "$DAEMON_PID"
for _ in $(seq 1 150); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$DAEMON_PID" 2>/dev/null && fail "daemon did not stop within 15 s of SIGTERM"
wait "$DAEMON_PID" 2>/dev/null || true
DAEMON_PID=""
T_END=$(date +%s)
say "ok: $VERSION_LINE, migrated to $CURRENT; build $((T_BUILD - T0)) s, install $((T_INSTALL - T_BUILD)) s, daemon $((T_END - T_INSTALL)) s, total $((T_END - T0)) s"
