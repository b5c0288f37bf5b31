"""The daemon process: wires config, registry, sources, coordinator, HTTP API and systemd together.

`hotswap daemon [-c config.toml]` runs `run_daemon`. Start order: migrate the
database, resume unfinished checkpoints, start sources (they scan at once),
start the API, write `<state_dir>/daemon.json` (pid and API URL, for the CLI
and tests), then tell systemd READY=1. SIGTERM/SIGINT stop it cleanly.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler

from daemon import systemd
from daemon.api import ApiServer, ApiState, create_app
from daemon.config import Config
from daemon.coordinator import Coordinator
from daemon.logging import configure_logging, get_logger
from daemon.metrics import DaemonMetrics
from daemon.registry import Registry
from daemon.registry import queries as q
from daemon.registry.db import redact_url
from daemon.sources.local import LocalSource

RUNTIME_FILE = "daemon.json"
# What the forward check imports on first use (~3 s on a laptop CPU).
_FORWARD_MODULES = (
    "torch",
    "safetensors.torch",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "daemon.checks.forward",
)

log = get_logger(__name__)


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.stop_event = threading.Event()
        self.registry = Registry(config.database_url)
        self.metrics = DaemonMetrics()
        self.coordinator = Coordinator(self.registry, config.checks, self.metrics)
        self.scheduler = BackgroundScheduler(daemon=True)
        self.sources: list[LocalSource] = []
        self.api: ApiServer | None = None
        self.rollout: Any = None  # daemon.rollout.service.RolloutService when [[workers]] exist
        self.runtime_file = config.state_dir / RUNTIME_FILE

    def start(self) -> None:
        cfg = self.config
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        log.info("starting", config=cfg.source_file, database=redact_url(cfg.database_url), pid=os.getpid())
        self.registry.upgrade()
        self.metrics.track_statuses(self._status_counts)
        self._preload_checks()
        install_post_verify_steps(self)
        self.coordinator.start()
        self.scheduler.start()
        for source_cfg in cfg.sources:
            source = LocalSource(source_cfg, self.coordinator.intake, scheduler=self.scheduler)
            source.start()
            self.sources.append(source)
        listen = cfg.daemon.listen_host_port
        if listen is not None:
            state = ApiState(
                self.registry,
                self.metrics,
                sources=[{"name": s.label, "path": str(s.root), "type": s.config.type} for s in self.sources],
                queue_depth=lambda: self.coordinator._queue.qsize(),
            )
            app = create_app(state)
            if self.rollout is not None:
                from daemon.rollout.api_routes import make_router

                app.include_router(make_router(self.rollout))
            self.api = ApiServer(app, *listen)
            self.api.start()
        # a checkpoint deferred for lack of memory is retried once its headroom check passes
        self.scheduler.add_job(
            self.coordinator.retry_deferred,
            "interval",
            seconds=cfg.checks.deferred_retry_s,
            id="retry-deferred",
            max_instances=1,
            coalesce=True,
        )
        interval = cfg.daemon.watchdog_interval_s or systemd.watchdog_interval_s()
        if interval:
            self.scheduler.add_job(systemd.watchdog_ping, "interval", seconds=interval, id="sd-watchdog")
        self._write_runtime_file()
        systemd.ready(f"watching {len(self.sources)} source(s)")
        log.info("ready", api=self.api.url if self.api else None, sources=[s.label for s in self.sources])

    def stop(self) -> None:
        systemd.stopping()
        log.info("stopping")
        for source in self.sources:
            source.stop()
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        self.coordinator.stop()
        if self.rollout is not None:
            self.rollout.stop()
        if self.api is not None:
            self.api.stop()
        self.runtime_file.unlink(missing_ok=True)
        self.registry.close()
        log.info("stopped")

    def _status_counts(self) -> dict[str, int]:
        with self.registry.session() as s:
            return q.status_counts(s)

    def _preload_checks(self) -> None:
        # torch + transformers take seconds to import: load them on the coordinator's thread
        # as soon as it starts, so the first checkpoint's forward check does not pay for it
        # (while registration, on the source threads, is never held up).
        if "forward" not in self.config.checks.enabled:
            return

        def load() -> None:
            t0 = time.perf_counter()
            try:
                for module in _FORWARD_MODULES:
                    importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - the forward check itself reports it
                log.warning("preloading the forward check failed", error=str(exc))
                return
            log.debug("forward check preloaded", seconds=round(time.perf_counter() - t0, 2))

        self.coordinator.warmup = load

    def _write_runtime_file(self) -> None:
        doc: dict[str, Any] = {
            "pid": os.getpid(),
            "api_url": self.api.url if self.api else None,
            "database": redact_url(self.config.database_url),
            "config": self.config.source_file,
            "started_at": time.time(),
        }
        tmp = self.runtime_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, self.runtime_file)


def install_post_verify_steps(d: Daemon) -> None:
    """Stage -> roll out: the rollout service takes every verified checkpoint (daemon.rollout).

    Without [[workers]] there is nothing to roll out to: the daemon only verifies.
    """
    if not d.config.workers:
        return
    from daemon.rollout.service import RolloutService

    d.rollout = RolloutService.from_config(d.config, d.registry)
    d.rollout.start(d.scheduler)
    d.coordinator.add_step("roll out", lambda ckpt: d.rollout.submit(ckpt.checkpoint_id))


def read_runtime_file(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((state_dir / RUNTIME_FILE).read_text())
    except (OSError, ValueError):
        return None


def run_daemon(config: Config) -> int:
    configure_logging(config.daemon.log_level)
    d = Daemon(config)
    signal.signal(signal.SIGTERM, lambda *_: d.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: d.stop_event.set())
    try:
        d.start()
        while not d.stop_event.wait(3600):
            pass
    finally:
        d.stop()
    return 0
