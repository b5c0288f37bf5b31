#!/usr/bin/env bash
# CI check of systemd/: every unit passes `systemd-analyze verify` with no message at all,
# every service scores at most $MAX_EXPOSURE in `systemd-analyze security`, and the sysusers.d
# and tmpfiles.d files create what the units expect.
#
# Works without systemd as PID 1 (containers, CI): the units are installed into a scratch root
# beside a copy of this host's own unit directory (sysinit.target and friends) and a stub
# /opt/hotswap/venv/bin/hotswap, and every command runs with --root= (security with
# --offline=yes). Needs systemd-analyze, systemd-sysusers and systemd-tmpfiles (Debian: the
# systemd package). Exit 0 only when every check ran and passed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
UNITS_DIR="${UNITS_DIR:-$ROOT/systemd}"   # another folder: tests of this script
MAX_EXPOSURE="${MAX_EXPOSURE:-4.5}"
# Instances stand in for the templates: verify and security need a concrete name.
SERVICES=(hotswap.service hotswap-loader.service hotswap-worker@0.service)
OTHERS=(hotswap-workers.target)

fail() { echo "check-units: FAIL: $*" >&2; exit 1; }

for tool in systemd-analyze systemd-sysusers systemd-tmpfiles; do
    command -v "$tool" >/dev/null || fail "$tool not found (Debian: apt-get install systemd)"
done
host_units=""
for d in /usr/lib/systemd/system /lib/systemd/system; do
    [ -f "$d/sysinit.target" ] && host_units="$d" && break
done
[ -n "$host_units" ] || fail "no systemd unit directory with sysinit.target on this host"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
sysroot="$scratch/root"
mkdir -p "$sysroot/usr/lib/systemd" "$sysroot/etc/systemd/system" "$sysroot/opt/hotswap/venv/bin" \
    "$sysroot/etc/sysusers.d" "$sysroot/etc/tmpfiles.d"
cp -a "$host_units" "$sysroot/usr/lib/systemd/system"
cp "$UNITS_DIR"/*.service "$UNITS_DIR"/*.target "$sysroot/etc/systemd/system/"
printf '#!/bin/sh\nexit 0\n' > "$sysroot/opt/hotswap/venv/bin/hotswap"
chmod 0755 "$sysroot/opt/hotswap/venv/bin/hotswap"

# 1. verify: rc 0 is not enough, unknown keys and bad values are warnings ("..., ignoring").
for unit in "${SERVICES[@]}" "${OTHERS[@]}"; do
    if ! out="$(systemd-analyze verify --root="$sysroot" --man=no "$unit" 2>&1)" || [ -n "$out" ]; then
        fail "systemd-analyze verify $unit:"$'\n'"$out"
    fi
    echo "verify   $unit: ok"
done

# 2. security: the overall exposure of each service, at most MAX_EXPOSURE.
for unit in "${SERVICES[@]}"; do
    out="$(systemd-analyze security --offline=yes --root="$sysroot" --no-pager "$unit" 2>&1)" || true
    score="$(printf '%s\n' "$out" | sed -n "s/.*Overall exposure level for ${unit}: \([0-9][0-9.]*\) .*/\1/p")"
    [ -n "$score" ] || fail "systemd-analyze security $unit printed no overall exposure:"$'\n'"$out"
    if awk -v s="$score" -v m="$MAX_EXPOSURE" 'BEGIN { exit !(s > m) }'; then
        fail "$unit: exposure $score > $MAX_EXPOSURE; what it allows:"$'\n'"$(printf '%s\n' "$out" | grep '✗')"
    fi
    echo "security $unit: $score (max $MAX_EXPOSURE)"
done

# 3. sysusers.d + tmpfiles.d: the user exists, the config and credentials directories get
#    their owners and modes (numeric ids from the scratch root's own passwd/group).
cp "$UNITS_DIR/sysusers.d/hotswap.conf" "$sysroot/etc/sysusers.d/"
cp "$UNITS_DIR/tmpfiles.d/hotswap.conf" "$sysroot/etc/tmpfiles.d/"
out="$(systemd-sysusers --root="$sysroot" 2>&1)" || fail "systemd-sysusers:"$'\n'"$out"
entry="$(grep '^hotswap:' "$sysroot/etc/passwd" || true)"
[ -n "$entry" ] || fail "sysusers.d/hotswap.conf made no hotswap user"
IFS=: read -r _ _ uid gid _ home shell <<<"$entry"
[ "$home" = /var/lib/hotswap ] || fail "hotswap's home is $home, not the daemon's StateDirectory /var/lib/hotswap"
case "$shell" in */nologin|/bin/false) ;; *) fail "hotswap has a login shell: $shell" ;; esac
[ "$uid" -gt 0 ] && [ "$uid" -lt 1000 ] || fail "hotswap uid $uid is not a system uid"
grep -q "^hotswap:x:$gid:" "$sysroot/etc/group" || fail "no hotswap group with gid $gid"
echo "sysusers hotswap: uid $uid gid $gid home $home shell $shell"

out="$(systemd-tmpfiles --root="$sysroot" --create hotswap.conf 2>&1)" || fail "systemd-tmpfiles:"$'\n'"$out"
[ -z "$out" ] || fail "systemd-tmpfiles warned:"$'\n'"$out"
want=("/etc/hotswap 750 0 $gid" "/etc/hotswap/credentials 700 0 0")
for w in "${want[@]}"; do
    path="${w%% *}"
    got="$path $(stat -c '%a %u %g' "$sysroot$path" 2>/dev/null || echo missing)"
    [ "$got" = "$w" ] || fail "tmpfiles.d: $got, want $w (mode uid gid)"
    echo "tmpfiles $w: ok"
done
echo "check-units: all units verified, every exposure <= $MAX_EXPOSURE"
