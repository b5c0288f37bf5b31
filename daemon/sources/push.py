"""`type = "push"`: trainers push checkpoints to the daemon over HTTP(S); see daemon.sources.push_routes.

The source serves the push routes on its own listener (`listen`, default 127.0.0.1:8781), so it can
speak TLS, and verify client certificates (mTLS) with `tls_client_ca_file`, without changing the
loopback control API: a client without a valid certificate fails the TLS handshake, before any
HTTP request is read, let alone a byte written. A committed push lands in `<path>/<version>/` and
is emitted with that directory (the fetch step has nothing to do). At start, every committed
directory already in `path` is emitted again (a daemon stopped between rename and registration
loses nothing; known versions are no-ops), and upload folders of an earlier run are removed.

The retention hook keeps `path` under `max_bytes` (0 = no limit), never deleting a protected version.
"""

from __future__ import annotations

import ssl
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit
from urllib.request import url2pathname

import uvicorn
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import BaseScheduler
from fastapi import FastAPI

from daemon.common import ListenerLimits, get_logger, guarded_protocol, read_token_file, tcp_listener
from daemon.formats import MANIFEST_NAME
from daemon.manifest import ManifestError, load_manifest, version_problem
from daemon.sources.base import DiscoveredCheckpoint, Emit, FetchError, FetchItem, Progress, SourceType
from daemon.sources.cache import prune_cache
from daemon.sources.push_gate import Limits
from daemon.sources.push_routes import PushState, clear_incoming, push_router
from daemon.sources.settings import PushSourceConfig

log = get_logger(__name__)
PUSH_LIMITS = ListenerLimits(max_connections=64, header_timeout_s=5.0, max_per_address=16)  # a few trainers, each one upload at a time


class PushServer:
    """uvicorn in a thread on a socket bound up front (port 0 works), optionally TLS / mTLS."""

    def __init__(self, app: FastAPI, listen: str, config: PushSourceConfig) -> None:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        self.sock = tcp_listener(host, int(port))
        self.sock.listen(PUSH_LIMITS.backlog)  # connections queue from here on, before uvicorn's loop runs
        self.host, self.port = host, int(self.sock.getsockname()[1])
        self.tls = bool(config.tls_cert_file)
        tls: dict[str, Any] = {}
        if self.tls:
            tls = {"ssl_certfile": config.tls_cert_file, "ssl_keyfile": config.tls_key_file}
            if config.tls_client_ca_file:
                tls |= {"ssl_ca_certs": config.tls_client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        # the internet-facing listener: a flood of idle or half-sent connections churns itself
        # (daemon.common.httpguard) and never takes file descriptors from the control API or workers
        cfg = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                             backlog=PUSH_LIMITS.backlog, http=guarded_protocol(PUSH_LIMITS, "push listener"), **tls)
        self.server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="push",
                                        daemon=True)  # fmt: skip

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # listening once uvicorn's loop runs: clients are not refused after start()

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=5)
        self.sock.close()


class PushSource:
    """The push listener as a `Source`: committed pushes are emitted with their directory."""

    config_type: ClassVar[type[PushSourceConfig]] = PushSourceConfig

    def __init__(self, config: PushSourceConfig, emit: Emit, scheduler: BaseScheduler | None = None) -> None:
        self.config = config
        self.label = config.label
        self.emit = emit
        self.root = Path(config.path).expanduser().absolute()
        limits = Limits(config.max_checkpoint_bytes, config.max_concurrent_uploads, config.rate_per_s,
                        config.burst, config.upload_timeout_s, config.auth_failures_per_s,
                        config.auth_failure_burst)  # fmt: skip
        self.state = PushState(self.root, limits, {k: Path(v).expanduser() for k, v in config.hmac_keys.items()},
                               {k: Path(v).expanduser() for k, v in config.ed25519_keys.items()}, self._committed)  # fmt: skip
        self._scheduler = scheduler
        self._own_scheduler = scheduler is None
        self._job_id = f"push-sweep:{self.root}"
        self.server: PushServer | None = None

    def app(self, token: str) -> FastAPI:
        """The push listener's ASGI app: the push routes behind `token` (served by `start`)."""
        app = FastAPI(title="hotswap push", docs_url=None, redoc_url=None, openapi_url=None)
        app.include_router(push_router(self.state, token))
        return app

    def start(self) -> None:
        token = read_token_file(Path(self.config.token_file).expanduser())  # a clear error when unusable
        self.root.mkdir(parents=True, exist_ok=True)
        clear_incoming(self.root)
        self.server = PushServer(self.app(token), self.config.listen, self.config)
        if self._scheduler is None:
            self._scheduler = BackgroundScheduler(daemon=True)
        every = max(0.2, min(60.0, self.config.upload_timeout_s / 4))
        self._scheduler.add_job(self.state.sweep, "interval", seconds=every, id=self._job_id, max_instances=1,
                                coalesce=True, replace_existing=True)  # fmt: skip
        if self._own_scheduler:
            self._scheduler.start()
        for child in sorted(self.root.iterdir()):
            if child.is_dir() and not child.name.startswith(".") and (child / MANIFEST_NAME).is_file():
                self._committed(child.name, child)  # refused (logged) when its name is no label
        self.server.start()
        log.info("push source listening", source=self.label, url=self.server.url, path=str(self.root),
                 mtls=bool(self.config.tls_client_ca_file))  # fmt: skip

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._scheduler is not None:
            if self._own_scheduler and self._scheduler.running:
                self._scheduler.shutdown(wait=False)
            elif self._scheduler.get_job(self._job_id) is not None:
                self._scheduler.remove_job(self._job_id)

    def describe(self) -> dict[str, Any]:
        return {"name": self.label, "type": "push", "path": str(self.root),
                "url": self.server.url if self.server else None, "mtls": bool(self.config.tls_client_ca_file)}  # fmt: skip

    def _committed(self, version: str, directory: Path) -> None:
        """Emit a committed push: its label is its folder's name, which the commit checked against the
        signed manifest (a folder put into `path` by other means is refused, with the reason, when not)."""
        why = version_problem(version)
        if why is None:
            try:
                listed = load_manifest(directory).version
            except ManifestError:
                listed = None  # the checks reject it with the parse error
            if listed is not None and listed != version:
                why = f"its manifest's version {listed!r} is not the folder's name {version!r}"
        if why is not None:
            log.warning("checkpoint refused", source=self.label, directory=str(directory), reason=why)
            return
        self.emit(DiscoveredCheckpoint(source=self.label, directory=directory, version=version, signal="push",
                                       uri=directory.as_uri(), detected_at=datetime.now(UTC)))  # fmt: skip

    def fetch(self, item: FetchItem, progress: Progress) -> Path:
        parts = urlsplit(item.uri)
        directory = Path(url2pathname(parts.path)) if parts.scheme == "file" else None
        if directory is None or not directory.is_dir():
            raise FetchError(f"{item.uri}: the pushed checkpoint is gone from {self.root}")
        return directory

    def prune(self, protected: frozenset[Path]) -> list[Path]:
        return prune_cache(self.root, self.config.max_bytes, protected, label=self.label)


# What daemon.sources.SOURCE_TYPES["push"] names; mypy checks it against the protocol.
_TYPE: SourceType = PushSource
