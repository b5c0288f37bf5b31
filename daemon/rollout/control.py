"""`hotswap rollback [--to VERSION]`, `hotswap pin VERSION`, `hotswap unpin`: manual control.

They act through the running daemon's HTTP API (the daemon owns the workers and
the rollout lock); when no daemon is running they fail with a message saying so.
The API address comes from `<state_dir>/daemon.json`, written by the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from daemon.config import CONFIG_ENV, ConfigError, load_config

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class NotRunning(RuntimeError):
    pass


def _daemon_url(config_path: str | None) -> str:
    from daemon.service import read_runtime_file

    config = load_config(config_path)
    runtime = read_runtime_file(config.state_dir)
    where = f"{config.state_dir}/daemon.json"
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
    url = _daemon_url(config_path)
    try:
        r = httpx.post(f"{url}{path}", json={**body, "wait_s": timeout_s}, timeout=timeout_s + 30)
    except httpx.TransportError as exc:
        raise NotRunning(f"the hotswap daemon at {url} does not answer ({exc})") from None
    try:
        doc = r.json()
    except ValueError:
        doc = {"error": r.text[:500]}
    if r.status_code != 200:
        raise RuntimeError(doc.get("error") or f"HTTP {r.status_code}")
    return doc


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"hotswap {prog}", description=description)
    p.add_argument("-c", "--config", default=None, help=f"config TOML (default: ${CONFIG_ENV} or the embedded default)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the command to finish")
    p.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    return p


def _run(args: argparse.Namespace, path: str, body: dict[str, Any]) -> int:
    try:
        doc = _post(args.config, path, body, args.timeout)
    except ConfigError as exc:
        print(f"hotswap: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (NotRunning, RuntimeError) as exc:
        print(f"hotswap: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(doc))
    else:
        print(_describe(doc))
    return EXIT_OK if doc.get("outcome") in ("succeeded", "pinned", "unpinned") else EXIT_FAILED


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
    p = _parser("rollback", "Roll every worker back to the version deployed before the serving one (or --to VERSION).")
    p.add_argument("--to", metavar="VERSION", default=None, help="a verified version to go back to")
    args = p.parse_args(argv)
    return _run(args, "/v1/rollout/rollback", {"to": args.to})


def pin_main(argv: Sequence[str] | None = None) -> int:
    p = _parser("pin", "Deploy VERSION and keep it: new checkpoints wait until `hotswap unpin`.")
    p.add_argument("version", metavar="VERSION")
    args = p.parse_args(argv)
    return _run(args, "/v1/rollout/pin", {"version": args.version})


def unpin_main(argv: Sequence[str] | None = None) -> int:
    p = _parser("unpin", "Let new checkpoints deploy again (the newest waiting one goes first).")
    args = p.parse_args(argv)
    return _run(args, "/v1/rollout/unpin", {})
