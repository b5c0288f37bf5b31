"""The read-only CLI commands: `hotswap history` and `hotswap status`.

They never create state: run from a folder where there is no database, they say where they
looked and how to point them at the daemon's (`-c config.toml` or `--state-dir DIR`), exit 2.

Everything user-controlled (versions, reasons, paths, URLs, worker names) is printed as plain
text: never read as rich markup or emoji codes, control characters shown escaped (a version
named `[/bold]` or one with an escape sequence neither crashes nor restyles the terminal).
`history` fits the terminal (80 columns and off a TTY too): columns are dropped by priority and
long values end in "…", never wrapped mid-word; `--wide` and `--json` print every full value.
`status` asks the running daemon (its `/status` and `/health`) when there is one, else the database;
`status --fleet` reads every host's row of the registry (the `fleet_versions` view) in one table,
then, under it, why each host that is not on the fleet target is behind (as its own agent wrote it).
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from daemon.cli.arrival import arrival_lines, delta_cell
from daemon.cli.text import fmt_bytes, safe
from daemon.common import client_tls
from daemon.config import Config, ConfigError, load_config


class NoState(ConfigError):
    """A read-only command found no database where it looked."""


def read_config(args: argparse.Namespace) -> Config:
    config = load_config(args.config)
    state_dir = getattr(args, "state_dir", None)
    if state_dir:
        config.daemon.state_dir = state_dir
    return config


def open_existing_registry(config: Config, upgrade: bool = True) -> Any:
    """The registry, refusing (one line) to create an SQLite database that does not exist."""
    from sqlalchemy.engine import make_url

    from daemon.registry import Registry
    from daemon.webhooks import install as install_webhooks

    url = make_url(config.database_url)
    if url.drivername.startswith("sqlite") and url.database not in (None, "", ":memory:"):
        path = Path(url.database).expanduser().absolute()
        if not path.is_file():
            raise NoState(
                f"no hotswap database at {path} (config: {config.source_file}); "
                "pass -c CONFIG or --state-dir DIR of the daemon's state"
            )
    reg = Registry(config.database_url, config.fleet.host or None)
    install_webhooks(reg, config.webhooks)  # what this command records is sent by this host's daemon
    if upgrade:
        reg.upgrade()  # an existing database written by an older version
    return reg


def read_runtime_file(config: Config) -> dict[str, Any] | None:
    try:
        doc = json.loads(config.runtime_file.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def daemon_alive(runtime: dict[str, Any] | None) -> bool:
    if not runtime or not runtime.get("pid"):
        return False
    try:
        os.kill(int(runtime["pid"]), 0)
    except (OSError, ValueError):
        return False
    return True


def plain(v: Any) -> Any:
    return v.isoformat() if isinstance(v, datetime) else v


# -- hotswap history ----------------------------------------------------------------------------

# (key, header, priority): lower priority numbers are kept longer when the terminal is narrow
_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("version", "version", 0),
    ("adapter", "adapter", 5),  # LoRA adapters: the name clients send as `model`
    ("status", "status", 0),
    ("discovered", "discovered", 6),
    ("verified", "verified", 5),
    ("deployed", "deployed", 2),
    ("ended", "rolled back / superseded", 4),
    ("updates", "worker updates", 7),
    ("bytes", "bytes", 3),
    ("delta", "delta of (delta/full; changed)", 5),  # delta checkpoints: the base, share of full bytes, changes
    ("reason", "reason", 1),
)
_SHRINKS = {"version": 12, "reason": 12, "ended": 14}  # may end in "…" down to this width
_STYLES = {"verified": "green", "deployed": "bold green", "rejected": "red", "deferred": "yellow",
           "duplicate": "dim", "superseded": "dim"}  # fmt: skip


def history_cells(row: dict[str, Any], ts: Callable[[datetime | None], str]) -> dict[str, str]:
    ended = (
        f"rolled back {ts(row['rolled_back_at'])}" if row.get("rolled_back_at")
        else f"superseded {ts(row['superseded_at'])}" if row.get("superseded_at") else ""
    )  # fmt: skip
    deployed = ts(row.get("deployed_at"))
    last = row.get("last_deployed_at")
    if last and row.get("deployed_at") and last != row["deployed_at"]:
        deployed += f" (again {ts(last)})"
    return {
        "version": safe(row["version"]),
        "adapter": safe(row.get("adapter_name") or ""),
        "status": safe(row["status"]),
        "discovered": ts(row.get("discovered_at")),
        "verified": ts(row.get("verified_at")),
        "deployed": deployed,
        "ended": ended,
        "updates": safe(row.get("worker_update_ms") or ""),
        "bytes": fmt_bytes(row.get("total_bytes")),
        "delta": delta_cell(row),
        "reason": safe(row.get("status_message") or ""),
    }


def fit_columns(cells: list[dict[str, str]], width: int) -> dict[str, int]:
    """Column key -> width for `width` terminal columns (rich's default box: 3 per column + 1).

    Columns are dropped by priority until the rest fit with the shrinkable ones (version, reason,
    ended) at their minimum; the space left then goes to those, in priority order."""
    def natural(key: str, header: str) -> int:
        return max([len(header), *(len(c[key]) for c in cells)])

    def minimum(key: str, header: str) -> int:
        nat = natural(key, header)
        return min(nat, max(_SHRINKS[key], len(header.split(" /")[0]))) if key in _SHRINKS else nat

    shown = [(k, h, p) for k, h, p in _COLUMNS if p == 0 or any(c[k] for c in cells)]
    while sum(minimum(k, h) + 3 for k, h, _ in shown) + 1 > width:
        droppable = [c for c in shown if c[2] > 0]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda c: c[2]))
    widths = {k: minimum(k, h) for k, h, _ in shown}
    spare = width - (sum(w + 3 for w in widths.values()) + 1)
    for k, h, _ in sorted((c for c in shown if c[0] in _SHRINKS), key=lambda c: c[2]):
        extra = max(0, min(spare, natural(k, h) - widths[k]))
        widths[k] += extra
        spare -= extra
    return widths


def history_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from daemon.cli.sqlite_read import history_rows

    config = read_config(args)
    adapter = getattr(args, "adapter", None)
    rows = history_rows(config.database_url, config.fleet.host, args.limit or None, adapter)
    if rows is None:  # not a plain SQLite file at the newest migration: the registry reads (and migrates)
        from daemon.registry import queries as q

        with open_existing_registry(config).session() as s:
            rows = q.history(s, limit=args.limit or None, adapter=adapter)
    if args.json:
        for r in rows:
            print(json.dumps({k: plain(v) for k, v in r.items()}))
        return 0
    console = Console(highlight=False, emoji=False)
    cells = [history_cells(r, ts_full) for r in rows]
    if not args.wide and _natural_width(cells) + 1 > console.width:  # narrow: times without the year
        cells = [history_cells(r, ts_short) for r in rows]
    widths: dict[str, int | None] = (
        {k: None for k, _, _ in _COLUMNS} if args.wide else dict(fit_columns(cells, console.width))
    )
    keys = [k for k, _, _ in _COLUMNS if k in widths]
    left_out = [h for k, h, _ in _COLUMNS if k not in keys and any(c[k] for c in cells)]
    title = f"hotswap history ({len(rows)} newest)" if args.limit else "hotswap history"
    if getattr(args, "adapter", None):
        title += f" of adapter {safe(args.adapter)}"
    notes = [f"left out to fit: {', '.join(left_out)} (--wide or --json for all)"] if left_out else []
    if any(c["reason"] for c in cells):  # a reason cut to fit: `show` prints it whole, wrapped
        notes.append("`hotswap show VERSION`: one version with its whole reason and every check")
    table = Table(title=title, caption="\n".join(notes) or None)
    headers = {k: h for k, h, _ in _COLUMNS}
    for k in keys:
        table.add_column(headers[k], no_wrap=True, overflow="fold" if args.wide else "ellipsis", width=widths[k],
                         justify="right" if k == "bytes" else "left")  # fmt: skip
    for c in cells:
        table.add_row(*(Text(c[k], style=_STYLES.get(c[k], "")) if k == "status" else Text(c[k]) for k in keys))
    if args.wide:  # every value whole: as wide as the table needs, whatever the terminal
        console = Console(highlight=False, emoji=False, width=max(console.width, _natural_width(cells, every=True) + 1))
    console.print(table)
    return 0


def _natural_width(cells: list[dict[str, str]], every: bool = False) -> int:
    """The table's width with each value whole: every column, or those that have a value."""
    return sum(max([len(h), *(len(c[k]) for c in cells)]) + 3 for k, h, p in _COLUMNS
               if every or p == 0 or any(c[k] for c in cells))  # fmt: skip


def ts_full(v: datetime | None) -> str:
    return v.strftime("%Y-%m-%d %H:%M:%S") if v else ""


def ts_short(v: datetime | None) -> str:
    return v.strftime("%m-%d %H:%M:%S") if v else ""


# -- hotswap status -----------------------------------------------------------------------------


EXIT_DAEMON_DOWN = 3  # `hotswap status`: the registry was read, but no daemon runs (or answers)


def status_cmd(args: argparse.Namespace) -> int:
    """Exit 0 while the daemon runs and answers, EXIT_DAEMON_DOWN (3) when it does not (what the
    registry says is printed either way), 2 for a bad config or no database. A running daemon is
    asked (its /status and /health); the registry is read here only when it does not answer."""
    config = read_config(args)
    if getattr(args, "fleet", False):
        return fleet_status(open_existing_registry(config), args.json, config.fleet.signing_key)
    runtime = read_runtime_file(config)
    running = daemon_alive(runtime)
    health: dict[str, Any] | None = None
    doc: dict[str, Any] | None = None
    if running and runtime and runtime.get("api_url"):
        from daemon.cli.daemon_get import ask_daemon

        doc, health = ask_daemon(str(runtime["api_url"]), client_tls(config.api, str(runtime["api_url"])))
    if doc is None:
        from daemon.api import ApiState, status_document
        from daemon.common import DaemonMetrics

        doc = status_document(ApiState(open_existing_registry(config), DaemonMetrics(), webhooks=config.webhooks))
    doc["daemon"] = {**doc.get("daemon", {}), "running": running, **(runtime or {})}
    doc["health"] = health
    if args.json:
        print(json.dumps(doc, default=plain))
    else:
        for line in status_lines(doc, config):
            print(line)
    answers = running and (health is None or "does not answer" not in str(health.get("error", "")))
    return 0 if answers else EXIT_DAEMON_DOWN


def problem_lines(problems: list[dict[str, Any]]) -> list[str]:
    """The problems block: one line each, critical first, with how long it has held."""
    now = time.time()
    out = []
    for p in problems:
        since = p.get("since")
        held = f" (for {_ago(now - since)})" if isinstance(since, int | float) and since > 0 else ""
        out.append(f"  problem:   {safe(p.get('severity'))} {safe(p.get('kind'))} {safe(p.get('subject'))}: "
                   f"{safe(p.get('reason'))}{held}")  # fmt: skip
    return out


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s} s" if s < 120 else f"{s // 60} min" if s < 7200 else f"{s // 3600} h"


def status_lines(doc: dict[str, Any], config: Config) -> list[str]:
    dd = doc["daemon"]
    out: list[str] = []
    if dd["running"]:
        out.append(f"daemon:      running (pid {dd.get('pid')}, {safe(dd.get('api_url') or 'API off')})")
    else:
        out.append("daemon:      not running")
    if dd.get("verify_only"):
        out.append(f"mode:        verify only: no [[workers]] in {safe(dd.get('config') or 'the config')}; "
                   "checkpoints are verified, never rolled out")  # fmt: skip
    health = doc.get("health")
    if health is not None:
        out.append("health:      ok" if health.get("ok") else f"health:      unhealthy: {safe(health.get('error'))}")
        out += problem_lines(health.get("problems") or [])
    out.append(f"database:    {safe(dd.get('database') or config.database_url)}")
    aliases = doc.get("aliases") or {}
    problems = doc.get("alias_problems") or {}
    for name in ("serving", "last_good", "pinned"):
        why = f"  (cannot be deployed here: {safe(problems[name])})" if name in problems else ""
        if name == "pinned" and aliases.get(name) and not why:
            waiting = [safe(r["version"]) for r in doc.get("latest") or [] if r.get("status") == "verified"]
            which = f" ({', '.join(waiting[:3])})" if waiting else ""
            why = f"  (newer versions wait for the pin{which}: `hotswap unpin` lets them deploy)"
        out.append(f"{name + ':':<12} {safe(aliases.get(name) or '-')}{why}")
    out += arrival_lines(doc.get("arrivals") or [])  # serving and pending versions: full or delta, what it cost
    for name, a in sorted((doc.get("adapters") or {}).items()):  # LoRA adapters, each with its own aliases
        pin = f", pinned {safe(a['pinned'])}" if a.get("pinned") else ""
        out.append(f"adapter:     {safe(name)} serving {safe(a.get('serving') or '-')}, "
                   f"last good {safe(a.get('last_good') or '-')}{pin}")  # fmt: skip
    if (w := dd.get("window")) is not None:  # a version on trial: last_good moves only at its verdict
        who = f"adapter {safe(w['adapter'])} {safe(w.get('version'))}" if w.get("adapter") else safe(w.get("version"))
        out.append(f"trial:       {who} in its health window, about {w.get('left_s')} s of {w.get('seconds')} s "
                   f"left (rollout {w.get('rollout_id')})")  # fmt: skip
    depth = dd.get("queue_depth")
    out.append(f"queue:       {depth if depth is not None else '- (daemon not running)'}")
    counts = ", ".join(f"{safe(k)} {v}" for k, v in sorted(doc.get("checkpoints", {}).items())) or "none"
    out.append(f"checkpoints: {counts}")
    if doc.get("latest"):
        newest = doc["latest"][0]
        out.append(f"newest:      {safe(newest['version'])} ({safe(newest['status'])})")
    for w in doc.get("workers", []):
        via = f" (last update via {safe(w['transport'])})" if w.get("transport") else ""
        out.append(f"worker:      {safe(w['worker'])} {safe(w.get('state') or '-')} "
                   f"{safe(w.get('weight_version') or '-')} {safe(w.get('url') or '-')}{via}")  # fmt: skip
        if w.get("last_error") and w.get("state") != "RUNNING":  # the cause; the log's lines: --json
            out.append(f"  error:     {safe(str(w['last_error']).splitlines()[0])}")
    for h in doc.get("webhooks") or []:  # undeliverable: given up after max_attempts (kept in webhook_deliveries)
        err = f"; last error: {safe(h['last_error'])}" if h.get("last_error") else ""
        out.append(f"webhook:     {safe(h['name'])} {h['delivered']} delivered, {h['pending']} pending "
                   f"({h['retrying']} retrying), {h['undeliverable']} undeliverable{err}")  # fmt: skip
    for src in doc.get("sources", []):
        out.append(f"source:      {safe(src.get('name'))} {safe(src.get('path') or src.get('url') or '')}".rstrip())
    return out



# (key, header, most width): `status --fleet` fits 80 columns; long names end in "…"
_FLEET_COLUMNS = (("host", "host", 16), ("serving", "serving", 16), ("last_good", "last good", 14),
                  ("state", "state", 8), ("lag", "lag", 3), ("workers", "workers", 7),
                  ("updating_to", "updating to", 14))  # fmt: skip
_FLEET_NAMES = ("host", "serving", "last_good", "updating_to")  # cut first when 80 columns are too few
_FLEET_STYLES = {"in sync": "green", "updating": "yellow", "behind": "red", "degraded": "red", "pinned": "cyan",
                 "silent": "red", "ahead": "yellow", "held": "cyan"}  # fmt: skip


def fleet_status(reg: Any, as_json: bool, signing_key: str = "") -> int:
    """`hotswap status --fleet`: every host's serving version, state and lag; a stalled staged
    rollout and a refused (forged) fleet target, named below the table."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from daemon.fleet import Trust, fleet_rows

    doc = fleet_rows(reg, Trust.from_file(signing_key))
    if as_json:
        print(json.dumps(doc, default=plain))
        return 0
    target = safe(doc["target"] or "-") + (" (set by an operator)" if doc["target_explicit"] else "")
    table = Table(title=f"fleet target: {target}", caption=f"this host: {safe(doc['host'])}")
    rows = [{**{k: safe(r.get(k) if r.get(k) is not None else "-") for k, _, _ in _FLEET_COLUMNS},
             "workers": f"{r.get('workers_running') or 0}/{r.get('workers') or 0}"} for r in doc["hosts"]]  # fmt: skip
    console = Console(highlight=False, emoji=False)
    width = {k: min(most, max([len(h), *(len(c[k]) for c in rows)])) for k, h, most in _FLEET_COLUMNS}
    while sum(width.values()) > console.width - 3 * len(width) - 1:  # the names give way, never state or lag
        name = max(_FLEET_NAMES, key=lambda k: width[k])
        if width[name] <= 4:
            break
        width[name] -= 1
    for key, header, _most in _FLEET_COLUMNS:
        table.add_column(header, no_wrap=True, overflow="ellipsis", width=width[key],
                         justify="right" if header in ("lag", "workers") else "left")  # fmt: skip
    for cells in rows:
        table.add_row(*(Text(cells[k], style=_FLEET_STYLES.get(cells[k], "")) if k == "state" else Text(cells[k])
                        for k, _, _ in _FLEET_COLUMNS))  # fmt: skip
    console.print(table)
    for r in doc["hosts"]:  # why each host is behind, as its agent wrote it: its own line(s), 80 columns
        if r.get("behind_reason") and r.get("state") not in ("in sync", "ahead"):
            console.print(Text(textwrap.fill(safe(r["behind_reason"]), 80, initial_indent=f"{safe(r['host'])}: ",
                                             subsequent_indent="  ", break_on_hyphens=False)))  # fmt: skip
    for what in ("stalled", "target_refused"):  # fleet-wide trouble (daemon.fleet.trust)
        if doc.get(what):
            console.print(Text(textwrap.fill(safe(f"fleet {what.replace('_', ' ')}: {doc[what]}"), 80,
                                             subsequent_indent="  ", break_on_hyphens=False), style="red"))  # fmt: skip
    return 0
