"""`BroadcastPush`: the trainer's side of the broadcast transport.

    push = BroadcastPush(state_dir="/var/lib/hotswap")      # daemon URL and control token from there
    result = push.push(f"step-{step}", model.state_dict(), step=step)
    result.ok, result.digest, result.workers                 # per-worker outcome, the workers' digest

One `push`: open a TCP store (rank 0) on `master_address:master_port` (0: a free port), ask the
daemon for a session (`POST /v1/broadcast`: it records the version and tells every worker to
join as ranks 1..N and to expect the table), build the group, take part in the "ready" vote,
broadcast the tensors in buckets, take part in the "done" vote, abort the group, then wait for
the daemon's verdict (`GET /v1/broadcast/{session}`). The daemon's result is the truth: the
workers' digest of what they received, who committed, who was put back on last good.
Raises `BroadcastFailed` (its `.result` holds the daemon's answer) when the version was not
taken; the workers are then back on the last good version.

`key_file=`/`key_id=` (and `key_alg=`, "hmac-sha256" or "ed25519"), as `hotswap publish`: the
push carries the content digest of its tensors (computed as the workers will) and a signature of
{version, table, digest}; a daemon with `[checks]` signing keys refuses an unsigned session.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

from daemon.checks import load_signer
from daemon.common import control_token_path, read_token_file
from daemon.transport import (
    DEFAULT_BUCKET_BYTES,
    TORCH_TO_ST,
    bucket_broadcast,
    buckets,
    parse_table,
    session_message,
    tensors_digest,
    vote,
)


class BroadcastFailed(RuntimeError):
    """The version was not taken: refused, timed out, or the workers' digests disagreed. Every
    worker is back on the last good version; `result` is the daemon's answer when there was one."""

    def __init__(self, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = result or {}


@dataclass(frozen=True)
class BroadcastResult:
    """A taken broadcast: the version, the digest every worker computed of what it received, the
    rollout that recorded it, each worker's report, and the seconds spent sending."""

    version: str
    ok: bool
    digest: str | None
    rollout_id: int | None
    workers: list[dict[str, Any]] = field(default_factory=list)
    send_s: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict)


class BroadcastPush:
    """Push a model's tensors straight into the serving workers' parameters, as one rollout.

    The daemon is found through `state_dir` (its `daemon.json` and `control.token`), or given
    as `daemon_url` and `token`. Each `push()` opens a session (`POST /v1/broadcast`), joins the
    workers in a torch.distributed group (NCCL for CUDA tensors, else gloo) at `master_address`,
    sends the tensors in buckets of `bucket_bytes`, and waits until the daemon took or undid the
    version, at most `timeout_s`. With `key_file` and `key_id` (as `hotswap publish`) the session
    is signed; the daemon refuses unsigned sessions when it has signing keys.
    """

    def __init__(
        self,
        daemon_url: str | None = None,
        *,
        state_dir: str | Path | None = None,
        token: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        backend: str | None = None,
        timeout_s: float = 60.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        key_file: str | Path | None = None,
        key_id: str | None = None,
        key_alg: str = "hmac-sha256",
    ) -> None:
        if daemon_url is None or token is None:
            if state_dir is None:
                raise ValueError("BroadcastPush needs state_dir, or both daemon_url and token")
            state = Path(state_dir)
            if daemon_url is None:
                try:
                    daemon_url = json.loads((state / "daemon.json").read_text())["api_url"]
                except (OSError, ValueError, KeyError) as exc:
                    raise ValueError(f"{state / 'daemon.json'}: no running daemon's API URL ({exc})") from None
            if token is None:
                token = read_token_file(control_token_path(state))
        if not daemon_url:
            raise ValueError("the daemon has no HTTP API (its [daemon] listen is off)")
        self.daemon_url = daemon_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        if (key_file is None) != (key_id is None):
            raise ValueError("BroadcastPush: key_file and key_id go together")
        # as `hotswap publish --key-file --key-id`: the daemon verifies with its [checks] keys
        self._signer = load_signer(key_alg, key_id, Path(key_file)) if key_file is not None and key_id else None

    def push(self, version: str, tensors: Mapping[str, torch.Tensor], *, step: int | None = None) -> BroadcastResult:
        """Broadcast `tensors` (e.g. `model.state_dict()`) as `version`; raises BroadcastFailed when
        it is not taken. A daemon that is busy or starting answers Retry-After, and this asks again
        until `timeout_s`."""
        named = {n: t.detach() for n, t in tensors.items()}
        if not named:
            raise ValueError("nothing to push: no tensors")
        device = next(iter(named.values())).device
        backend = self.backend or ("nccl" if device.type == "cuda" else "gloo")
        comm = device if backend == "nccl" else torch.device("cpu")
        table = [{"name": n, "dtype": TORCH_TO_ST[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape)}
                 for n, t in named.items()]  # fmt: skip
        signed = self._sign(version, table, named)
        timeout = timedelta(seconds=self.timeout_s)
        tcp = dist.TCPStore(self.master_address, self.master_port, None, True, timeout, wait_for_workers=False)
        pg: Any = None
        session: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            session = self._call("POST", "/v1/broadcast", {
                "version": version, "table": table, "master_address": self.master_address, "master_port": tcp.port,
                "backend": backend, "timeout_s": self.timeout_s, "bucket_bytes": self.bucket_bytes, "step": step, **signed,
            })  # fmt: skip
            store = dist.PrefixStore(f"hotswap/{session['group_name']}/", tcp)
            world = int(session["world_size"])
            pg = _group(store, world, backend, comm, timeout)
            try:
                if pg is None:
                    raise RuntimeError("the workers did not join")
                with torch.cuda.device(comm) if comm.type == "cuda" else contextlib.nullcontext():
                    if vote(pg, 1, comm, timeout):
                        self._send(pg, named, table, comm, timeout)
                        vote(pg, 1, comm, timeout)
            except Exception:  # noqa: BLE001 - the daemon's verdict below says what happened
                pass
        except Exception:
            if not session:
                raise
        finally:
            if pg is not None:
                with contextlib.suppress(Exception):
                    pg.abort()
            del tcp
        send_s = time.perf_counter() - t0
        result = self._wait(str(session["session"]))
        ok = result.get("outcome") == "succeeded"
        out = BroadcastResult(version, ok, result.get("digest"), result.get("rollout_id"),
                              list(result.get("workers") or []), send_s, result)  # fmt: skip
        if not ok:
            raise BroadcastFailed(f"broadcast of {version} failed: {result.get('reason')}", result)
        return out

    # -- details ----------------------------------------------------------------------------
    def _sign(self, version: str, table: list[dict[str, Any]], named: dict[str, torch.Tensor]) -> dict[str, Any]:
        """{digest, signature} for a signed session (computed before a byte is sent), else {}."""
        if self._signer is None:
            return {}
        digest = tensors_digest(parse_table(table), named)
        message = session_message(version, parse_table(table), digest)
        sig = self._signer
        return {"digest": digest, "signature": {"alg": sig.alg, "key_id": sig.key_id, "value": sig.sign(message)}}

    def _send(self, pg: Any, named: dict[str, torch.Tensor], table: list[dict[str, Any]], comm: torch.device,
              timeout: timedelta) -> None:  # fmt: skip
        flat = {n: t.contiguous().view(-1).view(torch.uint8) for n, t in named.items()}
        spec = parse_table(table)
        buf = torch.empty(min(self.bucket_bytes, max(1, sum(s.nbytes for s in spec.values()))), dtype=torch.uint8,
                          device=comm)  # fmt: skip
        for used, pieces in buckets(spec, self.bucket_bytes):
            view = buf[:used]
            for p in pieces:
                view[p.offset : p.offset + p.size].copy_(flat[p.name][p.start : p.start + p.size])
            bucket_broadcast(pg, view, timeout)

    def _wait(self, session: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s * 3 + 120
        while True:
            with httpx.Client(timeout=70) as c:
                r = c.get(f"{self.daemon_url}/v1/broadcast/{session}", params={"wait_s": 60}, headers=self._headers)
            if r.status_code == 200:
                doc: dict[str, Any] = r.json()
                return doc
            if r.status_code != 202 or time.monotonic() > deadline:
                raise BroadcastFailed(f"daemon: session {session}: HTTP {r.status_code}: {r.text[:200]}")

    def _call(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request; a transient refusal (Retry-After: the daemon starting, a worker busy with a
        rollout, another session running) is asked again until `timeout_s` has passed."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            with httpx.Client(timeout=30) as c:
                r = c.request(method, f"{self.daemon_url}{path}", json=body, headers=self._headers)
            try:
                doc = r.json()
            except ValueError:
                doc = {"error": r.text[:200]}
            if r.status_code in (200, 202):
                return dict(doc)
            retry_after = _retry_after_s(r.headers.get("Retry-After"))
            if retry_after is None or time.monotonic() + retry_after > deadline:
                raise BroadcastFailed(f"daemon refused the broadcast: HTTP {r.status_code}: {doc.get('error')}", doc)
            time.sleep(retry_after)


def _retry_after_s(header: str | None) -> float | None:
    """Retry-After in seconds (the daemon sends small integers); None when absent or unreadable."""
    try:
        seconds = float(header) if header is not None else math.nan
    except ValueError:
        return None
    return min(max(seconds, 0.1), 10.0) if math.isfinite(seconds) else None


def _group(store: Any, world: int, backend: str, comm: torch.device, timeout: timedelta) -> Any:
    """Rank 0 of the session's group (None when the workers never joined: the daemon says why)."""
    try:
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, 0, world, timeout)
        with torch.cuda.device(comm):  # NCCL binds the current device: the tensors' own
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, 0, world, opts)
    except Exception:  # noqa: BLE001
        return None
