"""`WorkerClient` for the reference worker (`hotswap worker`), over HTTP or a Unix socket.

Timeouts on every call (update and drain get their own, longer ones); only idempotent GETs are
retried (twice, on connection errors and timeouts). Errors map to the protocol's classes:
no answer -> WorkerUnreachable; 409/422 (refused, weights unchanged) -> UpdateRefused;
anything else -> WorkerError, with the worker's own message and the step in the text.

URLs: `http://127.0.0.1:8100` or `unix:/run/hotswap/worker0.sock`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from daemon.adapters.base import (
    Capabilities,
    ClientFactory,
    NonFiniteOutput,
    PauseMode,
    Timeouts,
    UpdateRefused,
    UpdateRequest,
    UpdateResult,
    WeightInfo,
    WorkerError,
    WorkerUnreachable,
    read_token,
)
from daemon.transport import TRANSPORTS

GET_RETRIES = 2
INFO_KEYS = ("version", "digest", "state", "in_flight", "tensors", "bytes", "device", "update_count")


def connect(name: str, url: str, *, token_file: str | None, timeouts: Timeouts) -> BuiltinWorkerClient:
    """The registry's factory (daemon.adapters.WORKER_KINDS["builtin"])."""
    return BuiltinWorkerClient(name, url, token_file=token_file or None, timeout_s=timeouts.request_s,
                               update_timeout_s=timeouts.update_s, drain_timeout_s=timeouts.drain_s)  # fmt: skip


class BuiltinWorkerClient:
    # Our own worker: it pauses and drains, takes every transport, validates before it writes and
    # restores its previous weights itself when a write fails.
    capabilities = Capabilities(
        pause_modes=("keep", "wait"),
        can_drain=True,
        transports=tuple(TRANSPORTS),
        restores_itself=True,
        atomic_updates=True,
        reports_in_flight=True,
    )

    def __init__(
        self,
        name: str,
        url: str,
        token: str | None = None,
        timeout: float = 10.0,
        *,
        token_file: str | Path | None = None,
        timeout_s: float | None = None,
        update_timeout_s: float = 300.0,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.name = name
        self.url = url
        if token is None and token_file:
            token = read_token(token_file, name)
        self.timeout = timeout_s if timeout_s is not None else timeout
        self.update_timeout = update_timeout_s
        self.drain_timeout = drain_timeout_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if url.startswith("unix:"):
            transport = httpx.HTTPTransport(uds=url.removeprefix("unix:"))
            base = "http://worker"
        else:
            transport = httpx.HTTPTransport()
            base = url.rstrip("/")
        self._http = httpx.Client(base_url=base, transport=transport, headers=headers, timeout=self.timeout)

    # -- plumbing ---------------------------------------------------------------------------
    def _call(
        self, method: str, path: str, step: str, *, json: Any = None, timeout: float | None = None
    ) -> httpx.Response:
        attempts = 1 + (GET_RETRIES if method == "GET" else 0)
        last: Exception | None = None
        for i in range(attempts):
            try:
                return self._http.request(method, path, json=json, timeout=timeout or self.timeout)
            except (httpx.TransportError, OSError) as exc:  # connect/read errors and timeouts
                last = exc
                if i + 1 < attempts:
                    time.sleep(0.1 * (i + 1))
        raise WorkerUnreachable(f"worker {self.name}: {step}: no answer from {self.url} ({type(last).__name__}: {last})")

    def _json(self, resp: httpx.Response, step: str) -> dict[str, Any]:
        try:
            doc = resp.json()
        except ValueError:
            doc = {"error": resp.text[:200]}
        if resp.status_code == 200:
            if not isinstance(doc, dict):
                raise WorkerError(f"worker {self.name}: {step}: answer is not a JSON object")
            return doc
        message = doc.get("error") if isinstance(doc, dict) else None
        text = f"worker {self.name}: {step}: HTTP {resp.status_code}: {message or resp.text[:200]}"
        if resp.status_code in (409, 422):
            raise UpdateRefused(text)
        raise WorkerError(text)

    def _admin(self, path: str, step: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        return self._json(self._call("POST", path, step, json=body or {}, timeout=timeout), step)

    # -- WorkerClient -------------------------------------------------------------------------
    def health(self) -> bool:
        try:
            return self._call("GET", "/health", "health").status_code == 200
        except WorkerUnreachable:
            return False

    def ready(self) -> bool:
        try:
            return self._call("GET", "/ready", "ready").status_code == 200
        except WorkerUnreachable:
            return False

    def weight_info(self) -> WeightInfo:
        doc = self._json(self._call("GET", "/weight_info", "weight_info"), "weight_info")
        return WeightInfo(
            version=doc.get("version"),
            digest=doc.get("digest"),
            state=str(doc.get("state", "UNKNOWN")),
            in_flight=int(doc.get("in_flight", 0)),
            tensors=int(doc.get("tensors", 0)),
            bytes=int(doc.get("bytes", 0)),
            device=str(doc.get("device", "cpu")),
            update_count=int(doc.get("update_count", 0)),
            extra={k: v for k, v in doc.items() if k not in INFO_KEYS},
        )

    def drain(self, timeout_s: float) -> None:
        doc = self._admin("/admin/drain", "drain", {"timeout_s": timeout_s}, timeout=timeout_s + self.timeout)
        if not doc.get("drained", False):
            raise WorkerError(
                f"worker {self.name}: drain: {doc.get('in_flight')} request(s) still in flight after {timeout_s} s"
            )

    def pause(self, mode: PauseMode = "keep") -> None:
        self._admin("/admin/pause", "pause", {"mode": mode, "timeout_s": self.drain_timeout},
                    timeout=self.drain_timeout + self.timeout)

    def resume(self) -> None:
        self._admin("/admin/resume", "resume")

    def update(self, request: UpdateRequest) -> UpdateResult:
        doc = self._admin("/admin/update", "update", request.to_json(), timeout=self.update_timeout)
        return UpdateResult(str(doc["version"]), float(doc.get("duration_ms", 0.0)), doc)

    def rollback(self, request: UpdateRequest) -> UpdateResult:
        """Back to an earlier version: the same in-place update, from the request the daemon kept."""
        return self.update(request)

    def restore(self) -> UpdateResult:
        """`POST /admin/rollback`: the worker's retained previous version, or after a failed write
        that could not be undone, the last good one."""
        doc = self._admin("/admin/rollback", "rollback", timeout=self.update_timeout)
        return UpdateResult(str(doc["version"]), float(doc.get("duration_ms", 0.0)), doc)

    def probe(self) -> str:
        doc = self._admin("/admin/probe", "probe", {"max_tokens": 4})
        if not doc.get("finite", True):
            raise NonFiniteOutput(f"worker {self.name}: probe: non-finite logits under version {doc.get('weight_version')}")
        return str(doc["weight_version"])

    def counters(self) -> dict[str, int]:
        info = self.weight_info()
        return {"requests_total": int(info.extra.get("requests_total", 0)),
                "requests_failed": int(info.extra.get("requests_failed", 0))}

    def close(self) -> None:
        self._http.close()


# What daemon.adapters.WORKER_KINDS["builtin"] names; mypy checks it against the protocol.
_FACTORY: ClientFactory = connect
