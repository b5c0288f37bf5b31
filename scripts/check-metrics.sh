#!/usr/bin/env bash
# `promtool check metrics` on Prometheus scrapes: names, HELP and TYPE lines, counter suffixes,
# base units.
#
#   scripts/check-metrics.sh SCRAPE...   each an http(s):// URL (fetched now) or a file
#   scripts/check-metrics.sh --install   only make sure promtool is there; print its path
#   scripts/check-metrics.sh --which     print promtool's path if it is there (never installs)
#   scripts/check-metrics.sh --server    make sure the Prometheus server binary is there; print its
#                                        path (tests/e2e/test_gates_prometheus.py starts it on loopback)
#
# e.g. scripts/check-metrics.sh http://127.0.0.1:8780/metrics (the daemon), and a worker's
# /metrics once it has one. tests/e2e/test_metrics_promtool.py scrapes a real daemon through this.
#
# promtool is taken from $HOTSWAP_PROMTOOL, else PATH, else the cache below. When none is
# there it is extracted from Debian's `prometheus` package into the cache: `apt-get download`
# plus `dpkg-deb -x`, promtool alone (a static binary), so nothing of the server is installed
# or started and no root is needed (apt-get update, when the lists are missing, does).
set -euo pipefail
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/hotswap-tools"

fail() { echo "check-metrics: FAIL: $*" >&2; exit 1; }

find_promtool() {
    if [ -n "${HOTSWAP_PROMTOOL:-}" ]; then echo "$HOTSWAP_PROMTOOL"; return; fi
    if command -v promtool >/dev/null 2>&1; then command -v promtool; return; fi
    if [ -x "$CACHE/promtool" ]; then echo "$CACHE/promtool"; return; fi
    return 1
}

find_server() {
    if [ -n "${HOTSWAP_PROMETHEUS:-}" ]; then echo "$HOTSWAP_PROMETHEUS"; return; fi
    if command -v prometheus >/dev/null 2>&1; then command -v prometheus; return; fi
    if [ -x "$CACHE/prometheus" ]; then echo "$CACHE/prometheus"; return; fi
    return 1
}

install_promtool() {  # [BINARY]: promtool (default) or prometheus, from the same package
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null ||
        fail "promtool not found and no apt-get/dpkg-deb to fetch it (install Prometheus' promtool)"
    local work
    work="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" RETURN
    local start=$SECONDS
    if ! (cd "$work" && apt-get download prometheus >/dev/null 2>&1); then
        echo "check-metrics: apt lists lack prometheus; running apt-get update" >&2
        apt-get update -qq >/dev/null || fail "apt-get update failed (needs root)"
        (cd "$work" && apt-get download prometheus >/dev/null) || fail "apt-get download prometheus failed"
    fi
    local deb
    deb="$(ls "$work"/prometheus_*.deb)"
    local bin="${1:-promtool}"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work" "./usr/bin/$bin"
    mkdir -p "$CACHE"
    mv "$work/usr/bin/$bin" "$CACHE/$bin.tmp" && mv "$CACHE/$bin.tmp" "$CACHE/$bin"
    echo "check-metrics: $bin from $(basename "$deb") ($(( $(stat -c %s "$deb") / 1000000 )) MB download," \
        "$(( $(stat -c %s "$CACHE/$bin") / 1000000 )) MB binary) in $(( SECONDS - start )) s" >&2
}

if [ "${1:-}" = "--server" ]; then
    server="$(find_server)" || { install_promtool prometheus; server="$CACHE/prometheus"; }
    "$server" --version >/dev/null 2>&1 || fail "$server does not run"
    echo "$server"
    exit 0
fi
if [ "${1:-}" = "--which" ]; then
    find_promtool
    exit
fi
promtool="$(find_promtool)" || { install_promtool; promtool="$CACHE/promtool"; }
"$promtool" --version >/dev/null 2>&1 || fail "$promtool does not run"

if [ "${1:-}" = "--install" ]; then
    echo "$promtool"
    exit 0
fi
[ $# -gt 0 ] || fail "no scrape given (usage: $0 URL|FILE... or --install)"

status=0
for scrape in "$@"; do
    case "$scrape" in
        http://*|https://*)
            body="$(curl -fsS --max-time 10 "$scrape")" || fail "cannot fetch $scrape"
            ;;
        *)
            [ -f "$scrape" ] || fail "$scrape: no such file"
            body="$(cat "$scrape")"
            ;;
    esac
    [ -n "$body" ] || fail "$scrape: empty scrape"
    if problems="$(printf '%s\n' "$body" | "$promtool" check metrics 2>&1)"; then
        echo "metrics  $scrape: ok ($(printf '%s\n' "$body" | grep -c '^# TYPE ') families)"
    else
        echo "metrics  $scrape: promtool found problems:"$'\n'"$problems" >&2
        status=1
    fi
done
exit $status
