"""`hotswap <command>`: the one entry point.

    hotswap --version                        print the installed version
    hotswap daemon   [-c config.toml]        run the control plane (daemon.service)
    hotswap publish  DIR [--version V] ...   write hotswap-manifest.json (last)
    hotswap history  [-c ...] [-n N] [--json] versions and what happened to them
    hotswap status   [-c ...] [--json] [--fleet]  daemon, checkpoints by status, workers (--fleet: every host)
    hotswap db upgrade [-c ...]              apply database migrations
    hotswap rollback [--to V] / pin V / unpin   manual control, through the running daemon's API
    hotswap verify DIR ...                   run the checks on a directory
    hotswap show VERSION                     one version: its status, reason and every check's result
    hotswap config check FILE                validate a config file without starting anything
    hotswap fleet target [VERSION|--clear]   the version a fleet converges to (shared PostgreSQL)
    hotswap worker ... / hotswap loader ...  the reference worker / staging loader

Commands owned by other packages are imported only when used (a CLI call never pays for
torch), and parse their own arguments. A bad config file is one error line and exit code 2.
Manual control acts through the running daemon's HTTP API (it owns the workers and the rollout
lock); the API address comes from `<state_dir>/daemon.json`, written by the daemon.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from daemon import __version__
from daemon.cli.config_check import add_parser as add_config_parser
from daemon.cli.show import add_parser as add_show_parser
from daemon.common import CONFIG_ENV, LOG_LEVELS, ConfigError

# Each command imports what it needs when it runs: `hotswap --version` and the parser import
# neither FastAPI nor SQLAlchemy (tests/cli/test_cli_speed.py).
# command -> "module:function" taking argv (list[str]) and returning an exit code
DELEGATED: dict[str, tuple[str, str]] = {
    "worker": ("daemon.worker:main", "run the reference serving worker"),
    "loader": ("daemon.loader:main", "run the staging loader (CUDA IPC exporter)"),
    "verify": ("daemon.cli.verify:main", "run the checks on a checkpoint directory"),
    "publish": ("daemon.cli.publish:publish_main", "write hotswap-manifest.json (last); --to s3://... uploads"),
    "push": ("daemon.cli.push:push_main", "stream a checkpoint to a daemon's push source (--to https://...)"),
    "rollback": ("daemon.cli.main:rollback_main", "roll every worker back to the version before (or --to VERSION)"),
    "pin": ("daemon.cli.main:pin_main", "deploy VERSION and hold it: new checkpoints wait"),
    "unpin": ("daemon.cli.main:unpin_main", "let new checkpoints deploy again"),
    "reverify": ("daemon.cli.reverify:main", "verify VERSION again from the start (e.g. after its files changed)"),
    "fleet": ("daemon.cli.fleet:main", "fleet target: print, set (VERSION) or clear the version every host converges to"),
}

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_RUNTIME = 1


def main(argv: Sequence[str] | None = None) -> int:
    args_list = _config_after_command(list(sys.argv[1:] if argv is None else argv))
    try:
        return _main(args_list)
    except BrokenPipeError:  # `hotswap show V | head`: the reader has gone; nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again
        return EXIT_RUNTIME


def _config_after_command(args: list[str]) -> list[str]:
    """`hotswap -c FILE status` is `hotswap status -c FILE` (-c before or after the command)."""
    if len(args) >= 3 and args[0] in ("-c", "--config"):
        return [args[2], args[0], args[1], *args[3:]]
    if len(args) >= 2 and args[0].startswith("--config="):
        return [args[1], args[0], *args[2:]]
    return args


def _main(args_list: list[str]) -> int:
    if args_list and args_list[0] in DELEGATED:
        return _delegate(args_list[0], args_list[1:])
    parser = _parser()
    args = parser.parse_args(args_list)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CONFIG
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_CONFIG)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        raise
    except Exception as exc:  # the daemon logs details; the terminal gets one line
        from daemon.registry import RegistryError

        if isinstance(exc, RegistryError):
            return _fail(str(exc), EXIT_RUNTIME)
        raise


def _fail(message: str, code: int) -> int:
    print(f"hotswap: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def _delegate(command: str, argv: list[str]) -> int:
    target, _ = DELEGATED[command]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return _fail(f"'hotswap {command}' is not available in this install ({module_name} missing)", 1)
        raise
    return int(getattr(module, func_name)(argv) or 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hotswap", description="Hot-swap LLM weights into running workers.")
    p.add_argument("--version", action="version", version=f"hotswap {__version__}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")

    def with_config(sp: argparse.ArgumentParser, state_dir: bool = False) -> argparse.ArgumentParser:
        sp.add_argument(
            "-c",
            "--config",
            default=None,
            help=f"config TOML (default: ${CONFIG_ENV}, else the embedded default: ./state, ./checkpoints)",
        )
        if state_dir:  # read-only commands: where the daemon's state is, overriding [daemon].state_dir
            sp.add_argument("--state-dir", default=None, help="the daemon's state folder (its hotswap.db, daemon.json)")
        return sp

    d = with_config(sub.add_parser("daemon", help="run the daemon (control plane)",
                                   description="Run the control plane. The options below replace the config "
                                   "file's keys (or the embedded default's) for this run."))  # fmt: skip
    d.add_argument("--listen", metavar="HOST:PORT", help="[daemon] listen: the HTTP API address (\"\" = off)")
    d.add_argument("--state-dir", metavar="DIR", help="[daemon] state_dir: database, tokens, runtime files")
    d.add_argument("--log-level", choices=LOG_LEVELS, help="[daemon] log_level")
    d.add_argument("--database-url", metavar="URL", help="[database] url (SQLAlchemy URL)")
    d.set_defaults(func=_cmd_daemon)

    h = with_config(sub.add_parser("history", help="checkpoint versions and what happened to them"), True)
    h.add_argument("-n", "--limit", type=int, default=50, help="newest N versions (0 = all)")
    h.add_argument("--json", action="store_true", help="JSON lines instead of a table (full values)")
    h.add_argument("--wide", action="store_true", help="every column with full values, whatever the terminal width")
    h.add_argument("--adapter", metavar="NAME", help="only the versions of this LoRA adapter")
    h.set_defaults(func=_cmd_history)

    s = with_config(sub.add_parser("status", help="daemon, checkpoints by status, workers",
                                   description="The daemon, its health, aliases, checkpoints by status and workers. "
                                   "Exit status: 0 the daemon runs and answers; 3 it does not (what the registry "
                                   "says is printed all the same); 2 a bad config or no database."), True)  # fmt: skip
    s.add_argument("--json", action="store_true", help="one JSON object with every field")
    s.add_argument("--fleet", action="store_true", help="every host of a fleet: serving version, state, lag")
    s.set_defaults(func=_cmd_status)

    add_show_parser(sub, with_config)  # hotswap show VERSION

    db = sub.add_parser("db", help="database maintenance")
    dbsub = db.add_subparsers(title="db commands", metavar="DBCOMMAND")
    up = with_config(dbsub.add_parser("upgrade", help="apply migrations up to the newest"))
    up.add_argument("--revision", default="head", help="the Alembic revision to migrate to (default: head)")
    up.set_defaults(func=_cmd_db_upgrade)
    cur = with_config(dbsub.add_parser("current", help="print the database's migration revision"), True)
    cur.set_defaults(func=_cmd_db_current)

    add_config_parser(sub)  # hotswap config check FILE

    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)  # dispatched before parsing; listed for --help
    return p


def _config(args: argparse.Namespace) -> Any:  # daemon.config.Config (imported when a command runs)
    from daemon.config import load_config

    return load_config(args.config)


def daemon_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """`hotswap daemon --listen/--state-dir/--log-level/--database-url` as config keys."""
    keys = {"listen": "listen", "state_dir": "state_dir", "log_level": "log_level"}
    out: dict[str, dict[str, Any]] = {}
    daemon = {key: getattr(args, opt) for opt, key in keys.items() if getattr(args, opt) is not None}
    if daemon:
        out["daemon"] = daemon
    if args.database_url is not None:
        out["database"] = {"url": args.database_url}
    return out


def _cmd_daemon(args: argparse.Namespace) -> int:
    from daemon.common import StateDirLocked
    from daemon.config import load_config
    from daemon.service import exit_now, run_daemon

    config = load_config(args.config, daemon_overrides(args))

    try:
        code = run_daemon(config)
        exit_now(code)  # stopped: the interpreter's teardown would add seconds
        return code
    except StateDirLocked as exc:
        print(f"hotswap daemon: {exc}", file=sys.stderr)
        return 2


def _registry(config: Any, migrate: bool = False) -> Any:
    from daemon.registry import Registry

    reg = Registry(config.database_url, config.fleet.host or None)
    if migrate:
        reg.upgrade()
    return reg


def _cmd_db_upgrade(args: argparse.Namespace) -> int:
    from daemon.registry import redact_url

    config = _config(args)
    reg = _registry(config)
    reg.upgrade(args.revision)
    print(f"{redact_url(config.database_url)}: at revision {reg.current_revision()}")
    return 0


def _cmd_db_current(args: argparse.Namespace) -> int:
    from daemon.cli.read import open_existing_registry, read_config

    reg = open_existing_registry(read_config(args), upgrade=False)
    print(reg.current_revision() or "(empty database)")
    return 0


def _cmd_history(args: argparse.Namespace) -> int:
    from daemon.cli.read import history_cmd

    return history_cmd(args)


def _cmd_status(args: argparse.Namespace) -> int:
    from daemon.cli.read import status_cmd

    return status_cmd(args)


# -- hotswap publish: daemon.cli.publish (re-exported: tests and scripts call it from here)
def __getattr__(name: str) -> Any:
    if name == "publish_main":
        from daemon.cli.publish import publish_main

        return publish_main
    raise AttributeError(name)


# -- hotswap rollback / pin / unpin: through the running daemon ----------------------------------


def _post(args: argparse.Namespace, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST to the running daemon with its control token; the daemon waits up to `timeout_s`."""
    from daemon.cli.control import post_control
    from daemon.cli.read import read_config

    return post_control(read_config(args), path, {**body, "wait_s": timeout_s}, timeout_s + 30, args.token_file)


def _control_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"hotswap {prog}", description=description)
    p.add_argument("-c", "--config", default=None, help=f"config TOML (default: ${CONFIG_ENV} or the embedded default)")
    p.add_argument("--state-dir", default=None, help="the daemon's state folder (its daemon.json, control.token)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the command to finish")
    p.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    p.add_argument("--token-file", metavar="FILE", default=None,
                   help="a named token's file ([[api.tokens]]; default: $HOTSWAP_TOKEN_FILE, else control.token)")
    return p


def _control(args: argparse.Namespace, path: str, body: dict[str, Any]) -> int:
    from daemon.cli.control import NotRunning
    from daemon.cli.read import safe

    try:
        doc = _post(args, path, body, args.timeout)
    except ConfigError as exc:
        print(f"hotswap: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (NotRunning, RuntimeError) as exc:
        print(f"hotswap: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    if args.json:
        print(json.dumps(doc))
    else:
        print(safe(_describe(doc) + (f" [as {doc['by']}]" if doc.get("by") else "")))  # versions and reasons come from checkpoints
    return EXIT_OK if doc.get("outcome") in ("succeeded", "pinned", "unpinned") else EXIT_RUNTIME


def _describe(doc: dict[str, Any]) -> str:
    if "unpinned" in doc:
        nxt = f"; deploying {doc['next']} next" if doc.get("next") else ""
        return f"unpinned (was {doc['unpinned'] or 'not pinned'}){nxt}"
    rid = f"rollout {doc['rollout_id']}: " if doc.get("rollout_id") else ""
    rid += f"adapter {doc['adapter']} " if doc.get("adapter") else ""
    text = f"{rid}{doc.get('version') or doc.get('pinned') or ''} {doc.get('outcome')}"
    if doc.get("from"):
        text += f" (from {doc['from']})"
    if doc.get("reason"):
        text += f": {doc['reason']}"
    return text


def rollback_main(argv: Sequence[str] | None = None) -> int:
    p = _control_parser("rollback", "Roll every worker back to the version deployed before the serving one (or --to VERSION).")
    p.add_argument("--to", metavar="VERSION", default=None, help="a verified version to go back to")
    p.add_argument("--adapter", metavar="NAME", default=None,
                   help="roll back this LoRA adapter only (to its last good version, or --to VERSION)")
    args = p.parse_args(argv)
    return _control(args, "/v1/rollout/rollback", {"to": args.to, "adapter": args.adapter})


def pin_main(argv: Sequence[str] | None = None) -> int:
    p = _control_parser("pin", "Deploy VERSION and keep it: new checkpoints wait until `hotswap unpin`.")
    p.add_argument("version", metavar="VERSION", help="a verified version (rejected ones need --force)")
    p.add_argument("--force", action="store_true", help="pin even a version that was rejected")
    args = p.parse_args(argv)
    return _control(args, "/v1/rollout/pin", {"version": args.version, "force": args.force})


def unpin_main(argv: Sequence[str] | None = None) -> int:
    p = _control_parser("unpin", "Let new checkpoints deploy again (the newest waiting one goes first).")
    p.add_argument("--adapter", metavar="NAME", default=None, help="unpin this LoRA adapter (pinned by `hotswap pin V`)")
    args = p.parse_args(argv)
    return _control(args, "/v1/rollout/unpin", {"adapter": args.adapter} if args.adapter else {})


if __name__ == "__main__":
    raise SystemExit(main())
