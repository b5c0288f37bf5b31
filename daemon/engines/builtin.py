"""`WorkerClient` for the reference worker (`hotswap worker`), over HTTP or a Unix socket.

Timeouts on every call (update and drain get their own, longer ones); only idempotent GETs are
retried (twice, on connection errors and timeouts). Errors map to the protocol's classes:
no answer -> WorkerUnreachable; 409/422 (refused, weights unchanged) -> UpdateRefused;
anything else -> WorkerError, with the worker's own message and the step in the text.

URLs: `http://127.0.0.1:8100` or `unix:/run/hotswap/worker0.sock`.

Identity (daemon/common/identity.py): the bearer token goes only to a peer that proved, on a fresh
nonce just before that request, that it holds the token (`POST /admin/identify`), unless the
URL is a Unix socket in a private directory (ours, 0700: no one else can be listening there).
The token file is re-read when it changes, so a managed worker's per-launch secret is picked up.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import httpx

from daemon.common import new_nonce, proof_ok
from daemon.engines.base import (
    AdapterRequest,
    AdapterResult,
    Capabilities,
    ClientFactory,
    NonFiniteOutput,
    PauseMode,
    PeerNotVerified,
    ServedAdapter,
    Timeouts,
    UpdateRefused,
    UpdateRequest,
    UpdateResult,
    WeightInfo,
    WorkerError,
    WorkerUnreachable,
    read_token,
)
from daemon.transport import TRANSPORTS, GroupSpec

GET_RETRIES = 2
INFO_KEYS = ("version", "digest", "state", "in_flight", "tensors", "bytes", "device", "update_count")


def connect(name: str, url: str, *, token_file: str | None, timeouts: Timeouts) -> BuiltinWorkerClient:
    """The registry's factory (daemon.engines.WORKER_KINDS["builtin"])."""
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
        adapters=True,  # unmerged LoRA by request `model` (daemon.worker.lora)
        adapter_swap_atomic=True,  # requests keep the version they were admitted with
        broadcast=True,  # joins a trainer's group (daemon.worker.weight_group)
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
        self._token = _TokenSource(name, token, Path(token_file) if token_file else None)
        self.timeout = timeout_s if timeout_s is not None else timeout
        self.update_timeout = update_timeout_s
        self.drain_timeout = drain_timeout_s
        self._socket: Path | None = None
        if url.startswith("unix:"):
            self._socket = Path(url.removeprefix("unix:"))
            transport = httpx.HTTPTransport(uds=str(self._socket))
            base = "http://worker"
        else:
            transport = httpx.HTTPTransport()
            base = url.rstrip("/")
        self._http = httpx.Client(base_url=base, transport=transport, timeout=self.timeout)

    # -- plumbing ---------------------------------------------------------------------------
    def _private_channel(self) -> bool:
        """A Unix socket in a directory only we can enter: whoever listens there is ours."""
        if self._socket is None:
            return False
        try:
            st = os.stat(self._socket.parent)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077

    def _verify_peer(self, step: str, token: str, timeout: float) -> None:
        """The peer proves it holds `token` on a fresh nonce; raises PeerNotVerified otherwise."""
        nonce = new_nonce()
        why: str
        try:
            resp = self._http.post("/admin/identify", json={"nonce": nonce}, timeout=min(timeout, self.timeout))
        except (httpx.TransportError, OSError):
            raise  # no answer at all: the caller's retry and WorkerUnreachable
        if resp.status_code == 200:
            try:
                given = resp.json().get("proof")
            except (ValueError, AttributeError):
                given = None
            if proof_ok(token.encode(), nonce, given):
                return
            why = "wrong proof"
        else:
            why = f"HTTP {resp.status_code} from /admin/identify"
        raise PeerNotVerified(f"worker {self.name}: {step}: the peer at {self.url} failed the identity check "
                              f"({why}); no token was sent to it")

    def _call(
        self, method: str, path: str, step: str, *, json: Any = None, timeout: float | None = None,
        auth: bool = True,
    ) -> httpx.Response:
        attempts = 1 + (GET_RETRIES if method == "GET" else 0)
        last: Exception | None = None
        for i in range(attempts):
            try:
                headers: dict[str, str] = {}
                token = self._token.get() if auth else None
                if token:
                    if not self._private_channel():
                        self._verify_peer(step, token, timeout or self.timeout)
                    headers["Authorization"] = f"Bearer {token}"
                return self._http.request(method, path, json=json, headers=headers, timeout=timeout or self.timeout)
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
            return self._call("GET", "/health", "health", auth=False).status_code == 200
        except WorkerUnreachable:
            return False

    def ready(self) -> bool:
        try:
            return self._call("GET", "/ready", "ready", auth=False).status_code == 200
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

    def update_and_resume(self, request: UpdateRequest) -> UpdateResult:
        """`POST /admin/update?then=resume`: write, resume, then probe while serving (ResumesAfterUpdate)."""
        doc = self._admin("/admin/update?then=resume", "update", request.to_json(), timeout=self.update_timeout)
        return UpdateResult(str(doc["version"]), float(doc.get("duration_ms", 0.0)), doc)

    def prepare(self, request: UpdateRequest) -> None:
        """`POST /admin/prepare`: open and validate `request`'s source now, while serving."""
        self._admin("/admin/prepare", "prepare", request.to_json(), timeout=self.update_timeout)

    def map_ahead(self, version: str | None, loader: str | None) -> None:
        """`POST /admin/map_ahead`: open `version`'s loader buffer now (MapsAhead); answered at once."""
        self._admin("/admin/map_ahead", "map_ahead", {"version": version, "loader": loader})

    def read_ahead(self, version: str | None, path: str | None, alg: str | None, reserve: int = 0) -> None:
        """`POST /admin/read_ahead`: read `version`'s files at `path` now (ReadsAhead); answered at once."""
        self._admin("/admin/read_ahead", "read_ahead", {"version": version, "path": path, "alg": alg, "reserve": reserve})

    def rollback(self, request: UpdateRequest) -> UpdateResult:
        """Back to an earlier version: the same in-place update, from the request the daemon kept."""
        return self.update(request)

    def restore(self) -> UpdateResult:
        """`POST /admin/rollback`: the worker's retained previous version, or after a failed write
        that could not be undone, the last good one."""
        doc = self._admin("/admin/rollback", "rollback", timeout=self.update_timeout)
        return UpdateResult(str(doc["version"]), float(doc.get("duration_ms", 0.0)), doc)

    def init_weight_group(self, spec: GroupSpec, timeout_s: float) -> None:
        self._admin("/admin/init_weight_group", "init_weight_group", spec.to_json(), timeout=timeout_s)

    def probe(self) -> str:
        doc = self._admin("/admin/probe", "probe", {"max_tokens": 4})
        if not doc.get("finite", True):
            raise NonFiniteOutput(f"worker {self.name}: probe: non-finite logits under version {doc.get('weight_version')}")
        return str(doc["weight_version"])

    # -- LoRA adapters (ServesAdapters) ------------------------------------------------------
    def load_adapter(self, request: AdapterRequest) -> AdapterResult:
        body = {"name": request.name, "version": request.version, "path": request.path,
                "expect": request.expect.to_json()}  # fmt: skip
        doc = self._admin("/admin/adapters/load", "load adapter", body, timeout=self.update_timeout)
        raw = doc.get("probe")
        probe: dict[str, Any] = raw if isinstance(raw, dict) else {}
        if probe.get("error") or probe.get("finite") is False:
            raise NonFiniteOutput(f"worker {self.name}: load adapter: probe under {request.name} {request.version}: "
                                  f"{probe.get('error') or 'non-finite logits'}")  # fmt: skip
        tokens = probe.get("token_ids")
        return AdapterResult(str(doc["name"]), str(doc["version"]), float(doc.get("ms", 0.0)),
                             list(tokens) if isinstance(tokens, list) else None, doc)  # fmt: skip

    def unload_adapter(self, name: str) -> None:
        self._admin("/admin/adapters/unload", "unload adapter", {"name": name})

    def adapters(self) -> dict[str, ServedAdapter]:
        served = self.weight_info().extra.get("adapters") or {}
        return {n: ServedAdapter(n, a.get("version"), a.get("path")) for n, a in served.items() if isinstance(a, dict)}

    def adapter_probe(self, name: str) -> tuple[str | None, list[int]]:
        doc = self._admin("/admin/probe", "adapter probe", {"max_tokens": 4, "adapter": name})
        if not doc.get("finite", True):
            raise NonFiniteOutput(f"worker {self.name}: probe: non-finite logits under adapter {name} "
                                  f"{doc.get('adapter_version')}")  # fmt: skip
        return doc.get("adapter_version"), list(doc.get("token_ids") or [])

    def adapter_counters(self, name: str) -> dict[str, int] | None:
        c = (self.weight_info().extra.get("adapter_requests") or {}).get(name) or {}
        return {"requests_total": int(c.get("requests_total", 0)), "requests_failed": int(c.get("requests_failed", 0))}

    def counters(self) -> dict[str, int]:
        info = self.weight_info()
        return {"requests_total": int(info.extra.get("requests_total", 0)),
                "requests_failed": int(info.extra.get("requests_failed", 0))}

    def close(self) -> None:
        self._http.close()


class _TokenSource:
    """The admin token: given, or read from its file again whenever the file changes."""

    def __init__(self, worker: str, token: str | None, path: Path | None) -> None:
        self.worker = worker
        self.path = path
        self._value = token
        self._seen: tuple[int, int, int] | None = None

    def get(self) -> str | None:
        if self.path is None:
            return self._value
        try:
            st = self.path.expanduser().stat()
        except FileNotFoundError:
            return None  # a managed worker not launched yet; its requests get 401
        except OSError as exc:
            raise WorkerError(f"worker {self.worker}: cannot read token file {self.path}: {exc.strerror}") from None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._seen:
            self._value = read_token(self.path, self.worker)
            self._seen = key
        return self._value


# What daemon.engines.WORKER_KINDS["builtin"] names; mypy checks it against the protocol.
_FACTORY: ClientFactory = connect
