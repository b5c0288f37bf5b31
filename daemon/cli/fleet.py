"""`hotswap fleet target [VERSION | --clear]`: read or set the version a fleet converges to.
`hotswap fleet rollout [status | pause | resume | abort]`: show or steer the staged rollout in
progress (daemon.fleet.stages; `[fleet] stages`).

The fleet target is one row of the shared PostgreSQL registry (`fleet_target`), read by every
fleet daemon each `[fleet] poll_s`; this command writes it directly (no daemon needed, any host
with the config). Without an explicit row the target is the newest verified, not rejected
version that was some host's `last_good` (now or before: `--clear` after an older target goes
back to the newer one; printed as "newest last_good"). Refused in one line, exit 2: a config
without fleet mode (nothing reads the row). Refused, exit 1: a version the registry does not
know, one never verified, or a rejected one (a single host can still be pinned to it with
`hotswap pin --force`).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import socket
import sys
from collections.abc import Sequence
from typing import Any

from daemon.cli.read import open_existing_registry, read_config, safe
from daemon.common import TokenFileError, control_token_path, read_token_file
from daemon.config import CONFIG_ENV, Config, ConfigError
from daemon.fleet import (
    StageCommandRefused,
    TargetRefused,
    Trust,
    command,
    fleet_target,
    set_fleet_target,
    stage_label,
    status,
)
from daemon.registry import Journal, RegistryError, summary_line

EXIT_OK, EXIT_RUNTIME, EXIT_CONFIG = 0, 1, 2
TOKEN_HELP = ("a named token's file ([[api.tokens]]; default $HOTSWAP_TOKEN_FILE): sent to this host's daemon, "
              "whose token roles apply; without one and with no daemon running, written directly")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hotswap fleet", description="Fleet-wide settings in the shared registry."
    )
    sub = p.add_subparsers(title="fleet commands", metavar="FLEETCOMMAND", help="what to do")
    t = sub.add_parser(
        "target", help="print, set (VERSION) or clear (--clear) the version every host converges to"
    )
    t.add_argument(
        "version", metavar="VERSION", nargs="?", default=None, help="a verified version to hold the fleet on"
    )
    t.add_argument(
        "--clear",
        action="store_true",
        help="back to the newest good version (some host's last_good, now or before)",
    )
    t.add_argument("-c", "--config", default=None, help=f"config TOML (default: ${CONFIG_ENV})")
    t.add_argument("--json", action="store_true", help="print the target as JSON")
    t.add_argument("--token-file", metavar="FILE", default=None, help=TOKEN_HELP)
    t.set_defaults(func=_cmd_target)
    r = sub.add_parser(
        "rollout", help="show (status) or steer (pause, resume, abort) the staged rollout in progress"
    )
    r.add_argument("action", nargs="?", default="status", choices=("status", "pause", "resume", "abort"))
    r.add_argument("-c", "--config", default=None, help=f"config TOML (default: ${CONFIG_ENV})")
    r.add_argument("--json", action="store_true", help="print the rollout as JSON")
    r.add_argument("--token-file", metavar="FILE", default=None, help=TOKEN_HELP)
    r.set_defaults(func=_cmd_rollout, version=None, clear=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CONFIG
    if args.version is not None and args.clear:
        return _fail("give VERSION or --clear, not both", EXIT_CONFIG)
    try:
        config = read_config(args)
        _require_fleet(config)
        return int(args.func(args, config))
    except ConfigError as exc:
        return _fail(str(exc), EXIT_CONFIG)
    except (RegistryError, TargetRefused, StageCommandRefused, RuntimeError) as exc:
        return _fail(str(exc), EXIT_RUNTIME)


def _require_fleet(config: Config) -> None:
    if not config.fleet.enabled:
        source = config.source_file or "the embedded default"
        raise ConfigError(
            f"{source}: [fleet] enabled is false: only fleet daemons (PostgreSQL, [fleet] enabled = true) "
            "read a fleet target; a single host is held on a version with `hotswap pin VERSION`"
        )


def _cmd_target(args: argparse.Namespace, config: Config) -> int:
    registry = open_existing_registry(config)
    try:
        version = None if args.clear else args.version
        if (args.clear or version is not None) and _via_daemon(args, config, "/v1/fleet/target", {"version": version}) is None:
            set_fleet_target(registry, version, by=_operator(config), trust=Trust.from_file(config.fleet.signing_key))
        doc = _describe(Journal(registry), Trust.from_file(config.fleet.signing_key))
    finally:
        registry.close()
    if args.json:
        print(json.dumps(doc))
    elif doc["version"] is None:
        print("fleet target: none (no explicit target, and no host has a last_good version yet)")
    else:
        how = (
            f"explicit, set by {doc['set_by']} at {doc['set_at']}" if doc["explicit"] else "newest last_good"
        )
        print(safe(f"fleet target: {doc['version']} ({how})"))
    return EXIT_OK


def _cmd_rollout(args: argparse.Namespace, config: Config) -> int:
    registry = open_existing_registry(config)
    try:
        done = None
        if args.action != "status":
            sent = _via_daemon(args, config, f"/v1/fleet/rollout/{args.action}", {})
            done = f"{sent['done']} [as {sent['by']}]" if sent else command(Journal(registry), args.action, by=_operator(config))
        doc = status(registry)
    finally:
        registry.close()
    if args.json:
        print(json.dumps(doc))
        return EXIT_OK
    if done is not None:
        print(safe(done))
    if doc is None:
        print(
            "no staged fleet rollout yet ([fleet] stages: a new version reaches one stage of hosts at a time)"
        )
        return EXIT_OK
    if doc.get("stalled"):
        print(safe(f"stalled: {doc['stalled']}"))
    why = f" ({doc['reason']})" if doc["reason"] else ""
    print(safe(f"staged rollout {doc['rollout_id']}: {doc['version']} (from {doc['previous']}), {doc['state']}{why}, "
               f"{stage_label(doc['stage'], len(doc['plan']))}"))  # fmt: skip
    for i, st in enumerate(doc["plan"]):
        size = st.get("names") or (f"{st['hosts']} hosts" if st.get("hosts") else f"{st.get('percent')} %")
        hosts = [h for h in doc["hosts"] if h["stage"] == i]
        line = ", ".join(f"{h['host']} {h['host_state']}" for h in hosts) or "no host yet"
        print(safe(f"  {stage_label(i, len(doc['plan']))} ({size}, bake {st.get('bake_s', 0)} s): {line}"))
        for g in doc.get("gates", []):  # every gate run of the version in this stage (daemon.gates)
            if g["stage"] == i:
                print(safe(f"    gate {summary_line(g)}"))
    return EXIT_OK


def _describe(journal: Journal, trust: Trust) -> dict[str, Any]:
    target = fleet_target(journal, trust)
    if target is None:
        return {"version": None, "explicit": False, "set_by": None, "set_at": None}
    return {"version": target.checkpoint.version, "explicit": target.explicit,
            "set_by": target.set_by, "set_at": target.set_at.isoformat() if target.set_at else None}  # fmt: skip


def _via_daemon(args: argparse.Namespace, config: Config, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """Through this host's running daemon, where the token's role is checked and its name recorded;
    None when no daemon runs here and no named token was given (the caller writes the row itself,
    as the holder of the database credentials and the control token)."""
    from daemon.cli.control import TOKEN_FILE_ENV, NotRunning, post_control

    try:
        doc = post_control(config, path, body, 60.0, args.token_file)
    except NotRunning as exc:
        if args.token_file or os.environ.get(TOKEN_FILE_ENV):
            raise RuntimeError(f"a named token acts through the daemon: {exc}") from None
        return None
    return doc


def _operator(config: Config) -> str:
    """Who decided, for the audit row: the credential used, never the environment (`LOGNAME` is
    whatever the caller sets). The control token (the one operator token today) when this user
    can read it, "control-token"; else the kernel's uid (its passwd name when it has one)."""
    try:
        read_token_file(control_token_path(config.state_dir))
        who = "control-token"
    except TokenFileError:
        uid = os.getuid()
        try:
            who = f"uid:{uid}({pwd.getpwuid(uid).pw_name})"
        except KeyError:  # no passwd entry (a container's arbitrary uid)
            who = f"uid:{uid}"
    return f"cli:{who}@{socket.gethostname()}"


def _fail(message: str, code: int) -> int:
    print(f"hotswap fleet: error: {' '.join(message.split())}", file=sys.stderr)
    return code
