"""A trainer process for the broadcast tests: `BroadcastPush` fed from a checkpoint directory.

    python tests/support_broadcast.py --state-dir S --weights DIR --version V [--count N]
        [--bucket-bytes B] [--timeout-s T] [--kill-after-buckets K] [--key-file F --key-id ID]
        [--tamper] [--hang-after-buckets K] --out RESULT.json

Pushes DIR's tensors N times (versions V-1 .. V-N when N > 1, as a training loop would), and
writes one JSON document per push to --out ({"ok", "result"} or {"ok": false, "error"}).
--kill-after-buckets K: SIGKILL itself after sending K buckets (a trainer dying mid-broadcast;
it prints `session <id>` first so the test can ask the daemon about it), or with --kill-pid P,
SIGKILL process P there (a worker dying mid-broadcast) and go on.
--key-file/--key-id: sign the session (as `hotswap publish`). --tamper: sign the tensors of DIR,
then send other bytes (one weight nudged). --hang-after-buckets K [--drip-s S]: send K buckets,
then one every S seconds, or (S = 0) none, never closing the group (a trainer that hangs or
crawls mid-session; it prints `session <id>` and `hanging`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from daemon.client.broadcast import BroadcastFailed, BroadcastPush
from daemon.transport.broadcast import buckets, parse_table
from daemon.transport.broadcast_worker import bucket_broadcast


class DyingPush(BroadcastPush):
    kill_after = 0
    victim = 0  # 0: the trainer kills itself; else this pid (a worker) dies and the trainer goes on

    def _call(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        doc = super()._call(method, path, body)
        print(f"session {doc.get('session')}", flush=True)
        return doc

    def _send(self, pg: Any, named: dict[str, torch.Tensor], table: list[dict[str, Any]], comm: torch.device,
              timeout: timedelta) -> None:  # fmt: skip
        flat = {n: t.contiguous().view(-1).view(torch.uint8) for n, t in named.items()}
        for i, (used, pieces) in enumerate(buckets(parse_table(table), self.bucket_bytes)):
            if i == self.kill_after:
                os.kill(self.victim or os.getpid(), signal.SIGKILL)
            view = torch.empty(used, dtype=torch.uint8)
            for p in pieces:
                view[p.offset : p.offset + p.size].copy_(flat[p.name][p.start : p.start + p.size])
            bucket_broadcast(pg, view, timeout)


class TamperingPush(BroadcastPush):
    """Signs the tensors it was given, then sends different bytes."""

    def _send(self, pg: Any, named: dict[str, torch.Tensor], table: list[dict[str, Any]], comm: torch.device,
              timeout: timedelta) -> None:  # fmt: skip
        first = next(iter(named))
        super()._send(pg, {**named, first: named[first] + 0.01}, table, comm, timeout)


class HangingPush(DyingPush):
    """Sends `kill_after` buckets, then one every `drip_s` seconds (each op well inside the group's
    timeout), or with drip_s 0 stops sending without dying or closing the group."""

    drip_s = 0.0

    def _send(self, pg: Any, named: dict[str, torch.Tensor], table: list[dict[str, Any]], comm: torch.device,
              timeout: timedelta) -> None:  # fmt: skip
        flat = {n: t.contiguous().view(-1).view(torch.uint8) for n, t in named.items()}
        for i, (used, pieces) in enumerate(buckets(parse_table(table), self.bucket_bytes)):
            if i == self.kill_after:
                print("hanging", flush=True)
            if i >= self.kill_after:
                threading.Event().wait(self.drip_s or None)  # drip_s 0: forever (the test kills it)
            view = torch.empty(used, dtype=torch.uint8)
            for p in pieces:
                view[p.offset : p.offset + p.size].copy_(flat[p.name][p.start : p.start + p.size])
            bucket_broadcast(pg, view, timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--bucket-bytes", type=int, default=1 << 20)
    ap.add_argument("--timeout-s", type=float, default=20.0)
    ap.add_argument("--kill-after-buckets", type=int, default=-1)
    ap.add_argument("--kill-pid", type=int, default=0, help="with --kill-after-buckets: SIGKILL this pid instead")
    ap.add_argument("--key-file")
    ap.add_argument("--key-id")
    ap.add_argument("--tamper", action="store_true")
    ap.add_argument("--hang-after-buckets", type=int, default=-1)
    ap.add_argument("--drip-s", type=float, default=0.0, help="with --hang-after-buckets: one bucket every S s")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(args.weights).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    cls: type[BroadcastPush] = BroadcastPush
    if args.hang_after_buckets >= 0:
        cls = HangingPush
    elif args.kill_after_buckets >= 0:
        cls = DyingPush
    elif args.tamper:
        cls = TamperingPush
    push = cls(state_dir=args.state_dir, timeout_s=args.timeout_s, bucket_bytes=args.bucket_bytes,
               key_file=args.key_file, key_id=args.key_id)  # fmt: skip
    if isinstance(push, DyingPush):
        push.kill_after, push.victim = max(args.kill_after_buckets, args.hang_after_buckets), args.kill_pid
    if isinstance(push, HangingPush):
        push.drip_s = args.drip_s
    docs = []
    for i in range(1, args.count + 1):  # the training loop
        version = args.version if args.count == 1 else f"{args.version}-{i}"
        try:
            r = push.push(version, tensors, step=i)
            docs.append({"ok": True, "version": version, "result": r.raw})
        except BroadcastFailed as exc:
            docs.append({"ok": False, "version": version, "error": str(exc), "result": exc.result})
    Path(args.out).write_text(json.dumps(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
