"""`hotswap <command>`: the one entry point.

    hotswap --version                        print the installed version
    hotswap daemon   [-c config.toml]        run the control plane (daemon.service)
    hotswap publish  DIR [--version V] ...   write hotswap-manifest.json (last)
    hotswap history  [-c ...] [-n N] [--json] versions and what happened to them
    hotswap status   [-c ...] [--json]       daemon, checkpoints by status, workers
    hotswap db upgrade [-c ...]              apply database migrations
    hotswap rollback [--to V] / pin V / unpin   manual control, through the running daemon's API
    hotswap verify DIR ...                   run the checks on a directory
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
from datetime import datetime
from typing import Any

from daemon import __version__
from daemon.config import CONFIG_ENV, Config, ConfigError, load_config
from daemon.publish_cmd import publish_main  # noqa: F401 - `hotswap publish` lives there

# command -> "module:function" taking argv (list[str]) and returning an exit code
DELEGATED: dict[str, tuple[str, str]] = {
    "worker": ("daemon.worker.server:main", "run the reference serving worker"),
    "loader": ("daemon.loader.server:main", "run the staging loader (CUDA IPC exporter)"),
    "verify": ("daemon.checks.cli:main", "run the checks on a checkpoint directory"),
    "publish": ("daemon.client.cli:publish_main", "write hotswap-manifest.json (last); --to s3://... uploads"),
    "push": ("daemon.client.cli:push_main", "stream a checkpoint to a daemon's push source (--to https://...)"),
    "rollback": ("daemon.cli:rollback_main", "roll every worker back to the version before (or --to VERSION)"),
    "pin": ("daemon.cli:pin_main", "deploy VERSION and hold it: new checkpoints wait"),
    "unpin": ("daemon.cli:unpin_main", "let new checkpoints deploy again"),
}

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_RUNTIME = 1


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
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
    except Exception as exc:  # the daemon logs details; the terminal gets one line
        from daemon.registry.db import RegistryError

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

    def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument(
            "-c",
            "--config",
            default=None,
            help=f"config TOML (default: ${CONFIG_ENV}, else the embedded default: ./state, ./checkpoints)",
        )
        return sp

    d = with_config(sub.add_parser("daemon", help="run the daemon (control plane)"))
    d.set_defaults(func=_cmd_daemon)

    h = with_config(sub.add_parser("history", help="checkpoint versions and what happened to them"))
    h.add_argument("-n", "--limit", type=int, default=50, help="newest N versions (0 = all)")
    h.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    h.set_defaults(func=_cmd_history)

    s = with_config(sub.add_parser("status", help="daemon, checkpoints by status, workers"))
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_status)

    db = sub.add_parser("db", help="database maintenance")
    dbsub = db.add_subparsers(title="db commands", metavar="DBCOMMAND")
    up = with_config(dbsub.add_parser("upgrade", help="apply migrations up to the newest"))
    up.add_argument("--revision", default="head")
    up.set_defaults(func=_cmd_db_upgrade)
    cur = with_config(dbsub.add_parser("current", help="print the database's migration revision"))
    cur.set_defaults(func=_cmd_db_current)

    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)  # dispatched before parsing; listed for --help
    return p


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config)


def _cmd_daemon(args: argparse.Namespace) -> int:
    config = _config(args)
    from daemon.service import run_daemon

    return run_daemon(config)


def _registry(config: Config, migrate: bool = False) -> Any:
    from daemon.registry import Registry

    reg = Registry(config.database_url)
    if migrate:
        reg.upgrade()
    return reg


def _cmd_db_upgrade(args: argparse.Namespace) -> int:
    from daemon.registry.db import redact_url

    config = _config(args)
    reg = _registry(config)
    reg.upgrade(args.revision)
    print(f"{redact_url(config.database_url)}: at revision {reg.current_revision()}")
    return 0


def _cmd_db_current(args: argparse.Namespace) -> int:
    reg = _registry(_config(args))
    print(reg.current_revision() or "(empty database)")
    return 0


def _cmd_history(args: argparse.Namespace) -> int:
    from daemon.registry import queries as q

    config = _config(args)
    reg = _registry(config, migrate=True)  # also works before the daemon ever ran
    with reg.session() as s:
        rows = q.history(s, limit=args.limit or None)
    if args.json:
        for r in rows:
            print(json.dumps({k: _plain(v) for k, v in r.items()}))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"hotswap history ({len(rows)} newest)" if args.limit else "hotswap history")
    for col in ("version", "status", "discovered", "verified", "deployed", "rolled back / superseded",
                "worker updates", "bytes", "reason"):  # fmt: skip
        t.add_column(col, overflow="fold", justify="right" if col == "bytes" else "left")
    for r in rows:
        ended = (
            f"rolled back {_ts(r['rolled_back_at'])}" if r.get("rolled_back_at")
            else f"superseded {_ts(r['superseded_at'])}" if r.get("superseded_at") else ""
        )  # fmt: skip
        t.add_row(
            r["version"],
            _status_style(r["status"]),
            _ts(r["discovered_at"]),
            _ts(r["verified_at"]),
            _ts(r["deployed_at"]),
            ended,
            r.get("worker_update_ms") or "",
            _bytes(r["total_bytes"]),
            r["status_message"] or "",
        )
    Console().print(t)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from daemon.api import ApiState, status_document
    from daemon.metrics import DaemonMetrics

    config = _config(args)
    reg = _registry(config, migrate=True)
    doc = status_document(ApiState(reg, DaemonMetrics()))
    runtime = read_runtime_file(config)
    doc["daemon"] = {"running": _daemon_alive(runtime), **(runtime or {})}
    if args.json:
        print(json.dumps(doc, default=_plain))
        return 0
    from rich.console import Console

    c = Console()
    dd = doc["daemon"]
    state = f"running (pid {dd.get('pid')}, {dd.get('api_url')})" if dd["running"] else "not running"
    c.print(f"daemon:      {state}")
    c.print(f"database:    {doc['daemon'].get('database') or config.database_url}")
    counts = ", ".join(f"{k} {v}" for k, v in sorted(doc["checkpoints"].items())) or "none"
    c.print(f"checkpoints: {counts}")
    if doc["latest"]:
        newest = doc["latest"][0]
        c.print(f"newest:      {newest['version']} ({newest['status']})")
    for w in doc["workers"]:
        c.print(f"worker:      {w['worker']} {w['state']} {w['weight_version'] or '-'}")
    return 0


def _daemon_alive(runtime: dict[str, Any] | None) -> bool:
    if not runtime or not runtime.get("pid"):
        return False
    try:
        os.kill(int(runtime["pid"]), 0)
    except (OSError, ValueError):
        return False
    return True


def _plain(v: Any) -> Any:
    return v.isoformat() if isinstance(v, datetime) else v


def _ts(v: datetime | None) -> str:
    return v.strftime("%Y-%m-%d %H:%M:%S") if v else ""


def _bytes(n: int | None) -> str:
    if not n:
        return ""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def _status_style(status: str) -> str:
    color = {
        "verified": "green",
        "deployed": "bold green",
        "rejected": "red",
        "deferred": "yellow",
        "duplicate": "dim",
        "superseded": "dim",
    }.get(status)
    return f"[{color}]{status}[/{color}]" if color else status


# -- hotswap publish: daemon.publish_cmd (re-exported: tests and scripts call it from here)


# -- hotswap rollback / pin / unpin: through the running daemon ----------------------------------


class NotRunning(RuntimeError):
    pass


def read_runtime_file(config: Config) -> dict[str, Any] | None:
    try:
        doc = json.loads(config.runtime_file.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _daemon_url(config_path: str | None) -> str:
    config = load_config(config_path)
    runtime = read_runtime_file(config)
    where = str(config.runtime_file)
    if not runtime:
        raise NotRunning(f"the hotswap daemon is not running (no {where}); start it with `hotswap daemon`")
    try:
        os.kill(int(runtime["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        raise NotRunning(
            f"the hotswap daemon is not running (pid {runtime.get('pid')} from {where} is gone); "
            "start it with `hotswap daemon`"
        ) from None
    if not runtime.get("api_url"):
        raise NotRunning("the running daemon has its HTTP API turned off ([daemon] listen = \"\")")
    return str(runtime["api_url"])


def _post(config_path: str | None, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    import httpx

    url = _daemon_url(config_path)
    try:
        r = httpx.post(f"{url}{path}", json={**body, "wait_s": timeout_s}, timeout=timeout_s + 30)
    except httpx.TransportError as exc:
        raise NotRunning(f"the hotswap daemon at {url} does not answer ({exc})") from None
    try:
        doc: dict[str, Any] = r.json()
    except ValueError:
        doc = {"error": r.text[:500]}
    if r.status_code != 200:
        raise RuntimeError(doc.get("error") or f"HTTP {r.status_code}")
    return doc


def _control_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"hotswap {prog}", description=description)
    p.add_argument("-c", "--config", default=None, help=f"config TOML (default: ${CONFIG_ENV} or the embedded default)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the command to finish")
    p.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    return p


def _control(args: argparse.Namespace, path: str, body: dict[str, Any]) -> int:
    try:
        doc = _post(args.config, path, body, args.timeout)
    except ConfigError as exc:
        print(f"hotswap: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (NotRunning, RuntimeError) as exc:
        print(f"hotswap: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    if args.json:
        print(json.dumps(doc))
    else:
        print(_describe(doc))
    return EXIT_OK if doc.get("outcome") in ("succeeded", "pinned", "unpinned") else EXIT_RUNTIME


def _describe(doc: dict[str, Any]) -> str:
    if "unpinned" in doc:
        nxt = f"; deploying {doc['next']} next" if doc.get("next") else ""
        return f"unpinned (was {doc['unpinned'] or 'not pinned'}){nxt}"
    rid = f"rollout {doc['rollout_id']}: " if doc.get("rollout_id") else ""
    text = f"{rid}{doc.get('version') or doc.get('pinned') or ''} {doc.get('outcome')}"
    if doc.get("from"):
        text += f" (from {doc['from']})"
    if doc.get("reason"):
        text += f": {doc['reason']}"
    return text


def rollback_main(argv: Sequence[str] | None = None) -> int:
    p = _control_parser("rollback", "Roll every worker back to the version deployed before the serving one (or --to VERSION).")
    p.add_argument("--to", metavar="VERSION", default=None, help="a verified version to go back to")
    args = p.parse_args(argv)
    return _control(args, "/v1/rollout/rollback", {"to": args.to})


def pin_main(argv: Sequence[str] | None = None) -> int:
    p = _control_parser("pin", "Deploy VERSION and keep it: new checkpoints wait until `hotswap unpin`.")
    p.add_argument("version", metavar="VERSION")
    args = p.parse_args(argv)
    return _control(args, "/v1/rollout/pin", {"version": args.version})


def unpin_main(argv: Sequence[str] | None = None) -> int:
    p = _control_parser("unpin", "Let new checkpoints deploy again (the newest waiting one goes first).")
    args = p.parse_args(argv)
    return _control(args, "/v1/rollout/unpin", {})


if __name__ == "__main__":
    raise SystemExit(main())
