"""Bringing a worker process back: the daemon's own managed children, and restart commands.

`launch = "managed"`: the daemon runs a reference worker itself as a supervised child.

The child is `hotswap worker --model DIR --version V --host 127.0.0.1 --port P
--token-file F --admin-uds S --device D`, with its log in `<state_dir>/logs/worker-NAME.log` (the
folder 0700, the log 0600).
Its pid, port and admin socket are kept in `<state_dir>/worker-NAME.json`, so a daemon that
was killed adopts the still-running child on its next start instead of starting a second one.

Identity (issue 10, finding 4; daemon/common/identity.py): the admin API is on the Unix socket S in a
private directory (`<state_dir>/run`, 0700; socket 0600), never on the TCP port, which carries
only serving; with `admin = "tcp"` it stays on the port and the daemon checks the peer's proof
before every token it sends. The token F is a fresh secret at every launch (0600 under the
state dir; only its path is on the command line), so a token seen by anyone is useless after
the next restart.

`Restarter`: a worker that cannot be restored over its admin API is restarted. External
workers get their configured `restart_command` (e.g. `systemctl restart hotswap-worker@0`),
run without a shell, with placeholders filled in per argument; managed workers are relaunched
by the daemon on the fallback checkpoint.

Also here: the embedded default's tiny seed checkpoint, made on first start so
the quickstart has something to serve before any checkpoint is dropped in.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

from daemon.bytepipe import hash_files

from daemon.common import (  # isort: skip (one statement in two lines: this module is near 450 lines)
    DIR_MODE, FILE_MODE, get_logger, open_private, private_dir, socket_dir, tcp_listener, tighten, write_private,
    write_secret)
from daemon.config import WorkerSpec
from daemon.formats import MANIFEST_NAME, tensor_table
from daemon.manifest import load_manifest, publish
from daemon.registry import CheckpointRef, Journal
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport import Expect, reference_for

log = get_logger(__name__)

SEED_VERSION = "tiny-seed"
STOP_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 120.0
OUTPUT_TAIL = 2000


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class PortTaken(RuntimeError):
    """The managed worker's TCP port is held by another process: not launched (it would exit)."""


LISTEN_BACKLOG = 1024  # connections that arrive while the worker is relaunched wait here, never refused


def ensure_token_file(path: Path) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_private(path, os.O_WRONLY | os.O_EXCL)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path


def ensure_seed(journal: Journal, state_dir: Path) -> CheckpointRef:
    """The tiny seed checkpoint (made and registered as deployed on first start)."""
    existing = journal.checkpoint_by_version(SEED_VERSION)
    if existing is not None and existing.local_path and Path(existing.local_path).is_dir():
        return existing
    directory = state_dir / "seed" / SEED_VERSION
    if not (directory / MANIFEST_NAME).exists():
        make_tiny_checkpoint(directory, seed=0, tokenizer=True)  # text prompts and chat work at once
        publish(directory, version=SEED_VERSION)
    manifest = load_manifest(directory)
    if manifest.digest is None:  # a format-1 seed left by an older install: give it strong hashes
        publish(directory, version=SEED_VERSION)
        manifest = load_manifest(directory)
    assert manifest.digest is not None
    table, _ = tensor_table(directory)
    ref = journal.register_seed(
        version=SEED_VERSION,
        local_path=str(directory.resolve()),
        digest=manifest.digest,
        total_bytes=sum(f.bytes for f in manifest.files),
        tensors=len(table),
    )
    log.info("seed_checkpoint", version=SEED_VERSION, path=str(directory))
    return ref


class ManagedWorker:
    def __init__(self, spec: WorkerSpec, state_dir: Path) -> None:
        self.spec = spec
        self.state_dir = state_dir
        self.token_file = Path(spec.token_file) if spec.token_file else state_dir / f"worker-{spec.name}.token"
        self.runtime_file = state_dir / f"worker-{spec.name}.json"
        self.log_file = state_dir / "logs" / f"worker-{spec.name}.log"
        self.port = spec.port or self._remembered_port() or free_port()
        self.admin_socket: Path | None = (
            socket_dir(state_dir) / f"worker-{spec.name}.sock" if spec.admin == "unix" else None
        )
        self.pid: int | None = None
        self.should_run = False  # launched (or meant to be) and not stopped by the daemon
        self._proc: subprocess.Popen[bytes] | None = None
        self.model: str | None = None
        self.version: str | None = None
        self.expect: Expect | None = None
        self.launches = 0  # launches by this daemon (the supervisor watches each one: daemon/controller/supervise.py)
        # The serving port, bound and listening in the daemon and inherited by every child it
        # launches: between a worker's death and its relaunch no other process can bind it
        # (another local user's server would answer clients under our version label).
        self._listener: socket.socket | None = None
        self.log_offset = 0  # where this launch's lines start in the log file
        self.kill_reason: str | None = None  # why the daemon killed this launch (a hung worker)
        ensure_token_file(self.token_file)
        for path, mode in ((self.log_file.parent, DIR_MODE), (self.log_file, FILE_MODE)):  # an install from before
            if (was := tighten(path, mode)) is not None:
                log.warning("worker log was open to other users; tightened", path=str(path), mode=f"{was:04o}")

    @property
    def url(self) -> str:
        """The serving URL (TCP): what clients use."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        """Where the daemon's client talks to it: the private socket, or the TCP port."""
        return f"unix:{self.admin_socket}" if self.admin_socket is not None else self.url

    def _remembered_port(self) -> int | None:
        try:
            doc = json.loads(self.runtime_file.read_text())
            return int(doc["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def adopt(self) -> bool:
        """Take over a child left running by a previous daemon process (same port, still alive)."""
        try:
            doc = json.loads(self.runtime_file.read_text())
            pid, port = int(doc["pid"]), int(doc["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if port != self.port or not self._is_our_worker(pid):
            return False
        self.pid = pid
        self.should_run = True
        self.model, self.version = doc.get("model"), doc.get("launched_version", doc.get("version"))
        log.info("managed_worker_adopted", worker=self.spec.name, pid=pid, port=port)
        return True

    def _is_our_worker(self, pid: int) -> bool:
        try:
            p = psutil.Process(pid)
            cmd = p.cmdline()
        except (psutil.Error, OSError):
            return False
        if self.admin_socket is not None and str(self.admin_socket) not in cmd:
            return False
        return p.status() != psutil.STATUS_ZOMBIE and "worker" in cmd and str(self.port) in cmd

    def expect_file(self) -> Path:
        return self.state_dir / f"worker-{self.spec.name}.expect.json"

    def hold_port(self) -> socket.socket:
        """The serving port's listening socket, bound once and kept for this daemon's life.
        Raises PortTaken when another process holds the port."""
        if self._listener is None:
            try:
                sock = tcp_listener("127.0.0.1", self.port)
                sock.listen(LISTEN_BACKLOG)
            except OSError as exc:
                log.error("managed_worker_port_taken", worker=self.spec.name, port=self.port, error=str(exc))
                raise PortTaken(f"managed worker {self.spec.name}: port {self.port} is held by another process; "
                                "not launching (free the port or set another `port`)") from None
            self._listener = sock
        return self._listener

    def release_port(self) -> None:
        """Close the daemon's copy of the serving port (a running child keeps its own)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def command(self, model: str, version: str | None, listen_fd: int | None = None,
                admin_socket: Path | None = None) -> list[str]:  # fmt: skip
        argv = [
            sys.executable, "-m", "daemon.cli.main", "worker",
            "--model", model,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *(["--listen-fd", str(listen_fd)] if listen_fd is not None else []),
            "--token-file", str(self.token_file),
            "--device", self.spec.device,
        ]  # fmt: skip
        if admin_socket or self.admin_socket:
            argv += ["--admin-uds", str(admin_socket or self.admin_socket)]
        if version:
            argv += ["--version", version]
        if self.expect is not None and self.expect.files:
            argv += ["--expect-file", str(self.expect_file())]
        return argv

    def launch(self, model: str, version: str | None, expect: Expect | None = None,
               admin_socket: Path | None = None) -> int:  # fmt: skip
        """Start the child on `model`; with `expect` (the registry's per-file digests) the child
        checks its initial load against them and refuses to start on a mismatch. Raises PortTaken
        when another process holds its port (it would be that process, not our worker, that
        clients reach there: an alert, never a RUNNING worker)."""
        self.should_run = True
        self.model, self.version = model, version  # what a later relaunch starts from
        listener = self.hold_port()
        private_dir(self.log_file.parent)  # <state_dir>/logs: 0700, each log 0600
        write_secret(self.token_file)  # a fresh secret for every launch
        self.expect = expect
        if expect is not None and expect.files:
            write_private(self.expect_file(), json.dumps(expect.to_json()).encode())
        argv = self.command(model, version, listener.fileno(), admin_socket)  # a socket of its own beside an old child
        with os.fdopen(open_private(self.log_file, os.O_WRONLY | os.O_APPEND), "ab") as logf:
            self.log_offset = logf.tell()
            # Own session: a Ctrl-C in the daemon's terminal does not hit the worker first;
            # the daemon stops it itself on shutdown.
            self._proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, pass_fds=(listener.fileno(),))  # fmt: skip
        self.pid = self._proc.pid
        self.kill_reason = None
        self.launches += 1
        self.model, self.version = model, version
        doc = {"pid": self.pid, "port": self.port, "model": model, "version": version, "launched_version": version,
               "admin_socket": str(self.admin_socket) if self.admin_socket else None}
        write_private(self.runtime_file, json.dumps(doc).encode())
        log.info("managed_worker_launched", worker=self.spec.name, pid=self.pid, port=self.port, version=version)
        return self.pid

    def record_serving(self, version: str) -> None:
        """`worker-NAME.json`'s `version` is what the worker serves now (an in-place update moves
        it); `model` stays the folder it was launched on."""
        if self.pid is None:
            return
        try:
            doc = json.loads(self.runtime_file.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(doc, dict) or doc.get("pid") != self.pid or doc.get("version") == version:
            return
        doc["version"] = version
        write_private(self.runtime_file, json.dumps(doc).encode())
    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    def forget_child(self) -> None:
        """Let go of the running child without stopping it (a restart rollout starts another beside it: daemon.rollout.relaunch)."""
        self.pid, self._proc = None, None

    def adopt_child(self, pid: int, proc: subprocess.Popen[bytes] | None, model: str | None, version: str | None,
                    expect: Expect | None) -> None:  # fmt: skip
        """The child let go by `forget_child` is the worker again (a handover abandoned)."""
        self.pid, self._proc, self.model, self.version, self.expect = pid, proc, model, version, expect
        self.should_run = True

    def needs_relaunch(self) -> bool:
        """Meant to be running (launched or adopted, not stopped by the daemon) but not alive."""
        return self.should_run and not self.alive()

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        return self._is_our_worker(self.pid)

    def exit_code(self) -> int | None:
        """The child's exit status once it exited (negative: killed by that signal); None while it
        runs or for an adopted child (not ours to wait for)."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self.should_run = False
        pid = self.pid
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.05)
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        self.pid, self._proc = None, None

    def kill(self, reason: str) -> None:
        """SIGKILL the child (it answers nothing: a SIGTERM would wait for it); still meant to run,
        so the supervisor relaunches it, on the port the daemon holds."""
        self.kill_reason = reason
        log.error("managed_worker_killed", worker=self.spec.name, pid=self.pid, reason=reason)
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def relaunch(self, model: str | None, version: str | None, expect: Expect | None = None) -> int:
        """Stop the child and start it on `model`. Refused (RuntimeError, the child left running)
        when `model` is missing, or its files do not match `expect` (hashed here, before the stop)."""
        same = not model or model == self.model
        model = model or self.model
        if not model:
            raise RuntimeError(f"managed worker {self.spec.name}: no checkpoint directory to relaunch on")
        if same:
            version = version or self.version
            expect = expect or self.expect
        problem = target_problem(model, expect)
        if problem is not None:
            raise RuntimeError(f"managed worker {self.spec.name}: not relaunched on {version or model}: {problem}")
        self.stop()
        return self.launch(model, version, expect)


# -- restart commands -----------------------------------------------------------------------


class _Placeholders(dict[str, str]):
    def __missing__(self, key: str) -> str:
        raise KeyError(key)


def fill(argv: list[str], values: dict[str, str]) -> list[str]:
    ph = _Placeholders(values)
    return [arg.format_map(ph) for arg in argv]


def target_problem(model: str, expect: Expect | None) -> str | None:
    """Why `model` must not be launched: missing, or its files differ from the verified digests."""
    root = Path(model)
    if not root.is_dir():
        return f"its directory {model} is missing"
    if expect is None or not expect.files:
        return None
    refs = [(f, r) for f in expect.files if (r := reference_for(f)) is not None]
    try:
        paths = [root / f.path for f, _ in refs]
        digests = hash_files(paths, alg=None) if any(not r.strong for _, r in refs) else []
        strong = {alg: hash_files([root / f.path for f, r in refs if r.alg == alg], alg=alg, crc=False)
                  for alg in {r.alg for _, r in refs if r.strong}}  # fmt: skip
    except OSError as exc:
        return f"a verified file cannot be read ({exc})"
    weak = iter(digests)
    by_alg = {alg: iter(ds) for alg, ds in strong.items()}
    for f, r in refs:
        d = next(by_alg[r.alg]) if r.strong else next(weak)
        got = d.hash if r.strong else d.crc32c
        if d.bytes != r.bytes or got != r.value:
            return f"{f.path} changed since it was verified"
    return None


class Restarter:
    """`expected(ckpt)`: the registry's per-file digests of a version (the managed child is
    launched with them); None launches without."""

    def __init__(self, expected: Callable[[CheckpointRef], Expect] | None = None) -> None:
        self.expected = expected

    def restart(
        self, spec: WorkerSpec, url: str, managed: ManagedWorker | None, fallback: CheckpointRef | None
    ) -> dict[str, Any]:
        """Issue the restart; returns what was done for the event's detail (`issued`: bool).

        Never onto a version whose directory is gone (or, managed, whose files fail their digests),
        and never kills a live managed child when there is no such version to start it on."""
        if fallback is not None and fallback.local_path and not Path(fallback.local_path).is_dir():
            return {"issued": False, "how": "none",
                    "error": f"{fallback.version}: its directory {fallback.local_path} is missing; not restarted"}  # fmt: skip
        if managed is not None:
            path = fallback.local_path if fallback else None
            version = fallback.version if fallback else None
            if path is None and managed.alive():
                return {"issued": False, "how": "managed relaunch",
                        "error": "no usable version to relaunch on; the running worker is left as it is"}  # fmt: skip
            expect = self.expected(fallback) if fallback is not None and self.expected is not None else None
            try:
                pid = managed.relaunch(path, version, expect)
            except Exception as exc:  # noqa: BLE001 - recorded in the event
                return {"issued": False, "how": "managed relaunch", "error": str(exc)}
            return {"issued": True, "how": "managed relaunch", "pid": pid, "version": version}
        argv = spec.restart_argv()
        if not argv:
            return {"issued": False, "how": "none", "error": "no restart_command configured"}
        parts = urlsplit(url)
        values = {
            "name": spec.name,
            "url": url,
            "port": str(parts.port or ""),
            "device": spec.device,
            "version": fallback.version if fallback else "",
            "path": (fallback.local_path or "") if fallback else "",
            "token_file": spec.token_file,
        }
        try:
            cmd = fill(argv, values)
        except KeyError as exc:
            return {"issued": False, "how": "command", "error": f"unknown placeholder {exc}"}
        log.warning("restart_command", worker=spec.name, argv=cmd)
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
                env=os.environ.copy(),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"issued": False, "how": "command", "argv": cmd, "error": str(exc)}
        out = (done.stdout + done.stderr)[-OUTPUT_TAIL:]
        if done.returncode != 0:
            log.warning("restart_command_failed", worker=spec.name, rc=done.returncode, output=out)
        # A non-zero exit is recorded, but the worker may still come back: we wait for it anyway.
        return {"issued": True, "how": "command", "argv": cmd, "rc": done.returncode, "output": out}
