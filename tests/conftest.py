"""Shared fixtures and helpers for hotswap tests (owned by the foundation; reuse freely).

Databases
    `db_url`      parametrized: "sqlite" (a file in tmp_path) always, and "postgres" when
                  $HOTSWAP_TEST_POSTGRES_URL is set (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test).
                  Each postgres test gets a FRESH database `hotswap_t_<random>` created on that server
                  and dropped afterwards. When the variable is set and the server is unreachable the
                  test FAILS (it never silently skips).
    `registry`    a migrated `daemon.registry.Registry` on `db_url`.

Running the real daemon
    `daemon_factory` fixture -> `start(**config) -> DaemonProcess`. It writes a config TOML in
    a tmp dir (state_dir, [database] url, one [[sources]] on a watch folder, listen on port 0),
    starts `python -m daemon.cli daemon -c <file>` as a subprocess and waits until it wrote
    `<state_dir>/daemon.json` (pid + API URL). All started daemons are killed at teardown.

        d = daemon_factory(db_url)                       # watch folder: d.watch_dir
        d = daemon_factory(db_url, sources=[{"path": str(p), "quiet_period_s": 0.5}],
                           checks={"enabled": ["manifest", "headers", "crc32c"]},
                           env={"HOTSWAP_TEST_VERIFY_DELAY_S": "5"}, hooked=True)
        d.wait_status("step-1", "verified")              # polls version_history; returns the row
        d.history()                                      # version_history rows (dicts), oldest first
        d.get("/status").json()                          # httpx call to the daemon's API
        d.kill() / d.stop(); d.restart(); d.log()        # SIGKILL / SIGTERM; same config again

    `hooked=True` starts it from tests/hooked_daemon.py instead (the same daemon, with the test
    observers its HOTSWAP_TEST_* environment variables ask for; production reads none of them).

    `make_config_file(path, **sections)` writes a TOML file from dicts (used by the factory).
    `wait_until(fn, timeout, interval, what)` polls until fn() is truthy, returns its value.
    `hotswap_cli(*args, cwd=..., env=...)` runs `python -m daemon.cli ARGS` and returns the
    CompletedProcess (text mode).
    `publish_tiny(dir, seed, version=None, shards=1)` makes a tiny Llama checkpoint + manifest.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[1]
POSTGRES_ENV = "HOTSWAP_TEST_POSTGRES_URL"
BACKENDS = ["sqlite"] + (["postgres"] if os.environ.get(POSTGRES_ENV) else [])

T = TypeVar("T")


# --------------------------------------------------------------------------- databases


def _postgres_database(server_url: str) -> Iterator[str]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    name = f"hotswap_t_{secrets.token_hex(6)}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # unreachable server with the variable set: fail, never skip
        admin.dispose()
        pytest.fail(f"{POSTGRES_ENV}={server_url} is set but PostgreSQL is not usable: {exc}", pytrace=False)
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'registry.db'}"
    else:
        yield from _postgres_database(os.environ[POSTGRES_ENV])


@pytest.fixture
def registry(db_url: str) -> Iterator[Any]:
    from daemon.registry import Registry

    reg = Registry(db_url)
    reg.upgrade()
    yield reg
    reg.close()


# --------------------------------------------------------------------------- helpers


def wait_until(
    fn: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "condition"
) -> T:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - keep polling; report the last error on timeout
            last_exc = exc
        if time.monotonic() > deadline:
            extra = f" (last error: {last_exc!r})" if last_exc else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(interval)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v))
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def make_config_file(path: Path, **sections: Any) -> Path:
    """Write TOML: a dict value is a [table], a list of dicts is an [[array of tables]]."""
    lines: list[str] = []
    for name, body in sections.items():
        if body is None:
            continue
        tables = body if isinstance(body, list) else [body]
        for table in tables:
            lines.append(f"[[{name}]]" if isinstance(body, list) else f"[{name}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
            lines.append("")
    path.write_text("\n".join(lines))
    return path


def hotswap_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"}
    full_env.update({"PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def publish_tiny(directory: Path, seed: int = 0, version: str | None = None, shards: int = 1) -> Any:
    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    make_tiny_checkpoint(directory, seed=seed, shards=shards)
    return publish(directory, version=version)


# --------------------------------------------------------------------------- the real daemon


class DaemonProcess:
    def __init__(
        self,
        workdir: Path,
        config_path: Path,
        db_url: str,
        watch_dir: Path,
        state_dir: Path,
        env: dict[str, str],
        hooked: bool = False,
    ) -> None:
        self.hooked = hooked
        self.workdir = workdir
        self.config_path = config_path
        self.db_url = db_url
        self.watch_dir = watch_dir
        self.state_dir = state_dir
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.api_url: str | None = None
        self._log_path = workdir / "daemon.log"
        self._registry: Any = None

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        runtime = self.state_dir / "daemon.json"
        runtime.unlink(missing_ok=True)
        log = open(self._log_path, "ab")  # noqa: SIM115 - lives as long as the process
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("HOTSWAP_CONFIG", None)
        entry = "tests.hooked_daemon" if self.hooked else "daemon.cli"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", entry, "daemon", "-c", str(self.config_path)],
            cwd=self.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

        def ready() -> dict[str, Any] | None:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                doc = json.loads(runtime.read_text())
            except (OSError, ValueError):
                return None
            return doc if doc.get("pid") == self.proc.pid else None  # type: ignore[union-attr]

        doc = wait_until(ready, timeout, 0.05, "the daemon to write daemon.json")
        self.api_url = doc["api_url"]
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> DaemonProcess:
        self.stop()
        return self.start()

    def log(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")
        except OSError:
            return ""

    def get(self, path: str, **kw: Any) -> Any:
        import httpx

        assert self.api_url, "the daemon API is off"
        return httpx.get(self.api_url + path, timeout=10, **kw)

    @property
    def registry(self) -> Any:
        if self._registry is None:
            from daemon.registry import Registry

            self._registry = Registry(self.db_url)
        return self._registry

    def history(self) -> list[dict[str, Any]]:
        from daemon.registry import queries as q

        with self.registry.session() as s:
            return q.history(s, newest_first=False)

    def row(self, version: str) -> dict[str, Any] | None:
        return next((r for r in self.history() if r["version"] == version), None)

    def wait_status(
        self, version: str, status: str | tuple[str, ...], timeout: float = 30.0
    ) -> dict[str, Any]:
        wanted = (status,) if isinstance(status, str) else status

        def check() -> dict[str, Any] | None:
            if not self.alive():
                raise AssertionError(f"daemon died:\n{self.log()[-4000:]}")
            r = self.row(version)
            return r if r is not None and r["status"] in wanted else None

        try:
            return wait_until(check, timeout, 0.05, f"{version} to be {'/'.join(wanted)}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; history={self.history()}\nlog:\n{self.log()[-3000:]}") from None

    def close(self) -> None:
        self.kill()
        if self._registry is not None:
            self._registry.close()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(
        db_url: str,
        *,
        sources: list[dict[str, Any]] | None = None,
        checks: dict[str, Any] | None = None,
        daemon: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        wait: bool = True,
        hooked: bool = False,
    ) -> DaemonProcess:
        n = len(started)
        workdir = tmp_path / f"daemon{n}"
        workdir.mkdir()
        watch = workdir / "checkpoints"
        state = workdir / "state"
        cfg = make_config_file(
            workdir / "config.toml",
            daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "log_level": "debug", **(daemon or {})},
            database={"url": db_url},
            sources=sources if sources is not None else [{"path": str(watch), "rescan_interval_s": 5.0}],
            checks=checks,
            **(extra or {}),
        )
        d = DaemonProcess(workdir, cfg, db_url, watch, state, env or {}, hooked)
        started.append(d)
        return d.start() if wait else d

    yield start
    for d in started:
        d.close()

