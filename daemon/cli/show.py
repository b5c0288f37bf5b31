"""`hotswap show VERSION`: one version in full, with every check's result.

The history table cuts long values to fit the terminal; this prints everything about one version,
the status message and each check's detail wrapped at word boundaries (never cut), so a rejection
reason can be read whole. Read-only, like `history`: it never creates a database. `--json` prints
the same as one object. Exit codes: 0 found, 1 no such version, 2 no database / bad config.
"""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
from typing import Any

_FIELDS = (  # (key of version_history, label)
    ("status", "status"),
    ("status_message", "reason"),
    ("step", "step"),
    ("parent", "parent"),
    ("digest", "digest"),
    ("total_bytes", "bytes"),
    ("encoding", "encoding"),
    ("delta_base", "delta of"),
    ("fetched_bytes", "bytes fetched"),
    ("delta_ratio", "delta/full"),
    ("tensors_changed", "tensors changed"),
    ("elements_changed", "elements changed"),
    ("compacted_from", "compacted from"),
    ("compacted_bytes", "compacted bytes"),
    ("tensor_count", "tensors"),
    ("source", "source"),
    ("commit_signal", "committed by"),
    ("local_path", "path"),
    ("discovered_at", "discovered"),
    ("verified_at", "verified"),
    ("verify_ms", "verify ms"),
    ("deployed_at", "deployed"),
    ("last_deployed_at", "last deployed"),
    ("rolled_back_at", "rolled back"),
    ("superseded_at", "superseded"),
    ("rollout_count", "rollouts"),
    ("last_rollout_outcome", "last rollout"),
    ("worker_update_ms", "worker updates"),
)
_PAD = max(len(label) for _key, label in _FIELDS) + 1  # the values line up after the longest label


def add_parser(sub: Any, with_config: Any) -> None:
    sp = with_config(sub.add_parser("show", help="one version in full: status, reason, every check's result",
                                    description="Print one version's record in full: its status and the "
                                    "whole reason, then every check with its result and detail."), True)  # fmt: skip
    sp.add_argument("version", metavar="VERSION", help="the version label (as `hotswap history` lists it)")
    sp.add_argument("--json", action="store_true", help="one JSON object: the record and its checks")
    sp.set_defaults(func=show_cmd)


def show_cmd(args: argparse.Namespace) -> int:
    from daemon.cli.read import open_existing_registry, plain, read_config, safe
    from daemon.registry import queries as q
    from daemon.registry import summary

    reg = open_existing_registry(read_config(args))
    with reg.session() as s:
        ckpt = q.get_checkpoint(s, args.version)
        if ckpt is None:
            print(f"hotswap: error: no version {safe(args.version)!s} in the registry (see `hotswap history`)")
            return 1
        row = next(iter(q.history(s, checkpoint_id=ckpt.id)), {})
        checks = [{"name": c.name, "status": c.status or ("pass" if c.ok else "fail"), "duration_ms": c.duration_ms,
                   "started_at": c.started_at, "detail": c.detail} for c in q.checks_of(s, ckpt.id)]  # fmt: skip
        gates = summary(s, ckpt.id)
    if args.json:
        print(json.dumps({"record": {k: plain(v) for k, v in row.items()},
                          "checks": [{k: plain(v) for k, v in c.items()} for c in checks], "gates": gates}))  # fmt: skip
        return 0
    for line in show_lines(row, checks, shutil.get_terminal_size((100, 24)).columns, gates):
        print(line)
    return 0


def show_lines(row: dict[str, Any], checks: list[dict[str, Any]], width: int,
               gates: list[dict[str, Any]] | None = None) -> list[str]:  # fmt: skip
    """The record as `label: value` lines, long values wrapped under their label, then the checks
    and the gates it was tried by on each host (daemon.gates)."""
    from daemon.cli.read import safe, ts_full
    from daemon.registry import summary_line

    width = max(width, 40)
    out = [f"{'version:':<{_PAD}} {safe(row.get('version'))}"]
    for key, label in _FIELDS:
        value = row.get(key)
        if value is None or value == "":
            continue
        text = ts_full(value) if hasattr(value, "strftime") else _number(key, value) if isinstance(value, float) else safe(value)
        out += _wrapped(f"{label + ':':<{_PAD}} ", text, width)
    out.append(f"{'checks:':<{_PAD}} {len(checks) or 'none recorded'}")
    for c in checks:
        out.append(f"  {safe(c['name'])}: {safe(c['status'])} ({c['duration_ms']:.0f} ms)")
        for k, v in (c["detail"] or {}).items():
            out += _wrapped(f"    {safe(k)}: ", safe(v if isinstance(v, str) else json.dumps(v)), width)
    if gates:
        out.append(f"{'gates:':<{_PAD}} {len(gates)}")
    for g in gates or []:
        stage = f"stage {g['stage'] + 1}: " if g["stage"] is not None else ""
        out += _wrapped("  ", safe(stage + summary_line(g)), width)
        if g.get("output") and g["last"] != "passed":  # an eval's tails, to read why
            out += ["    " + safe(ln) for ln in str(g["output"]).splitlines()[-12:]]
    return out


def _number(key: str, value: float) -> str:
    return f"{100 * value:.2f} %" if key == "delta_ratio" else f"{value:.1f}"  # a ratio of 0.034 is not "0.0"


def _wrapped(head: str, text: str, width: int) -> list[str]:
    pad = " " * len(head)
    lines = textwrap.wrap(text, width=width, initial_indent=head, subsequent_indent=pad,
                          break_long_words=True, break_on_hyphens=False)  # fmt: skip
    return lines or [head.rstrip()]
