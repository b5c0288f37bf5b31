"""Checks whose cost follows the input (safetensors parsing, compat, the forward canary) run in a
child process, under a deadline: killed past it, and the check fails with a reason.

A checkpoint chooses how long these run (a header of a million tensors, a pattern in
`adapter_config.json`, a config.json asking for a huge model) and some of that time holds the GIL;
in the daemon's own process that stops the API, the supervision and the watchdog pings (issue 37:
`/livez` silent for 63 s). Here the daemon's thread only waits on a pipe, pinging the watchdog
(`beat`) meanwhile. The child is started once (spawn: no fork of a threaded daemon) and reused, so
its imports and canary skeletons are paid once; one that ran past its limit is killed and the
next check starts a fresh one. It is a plain `python -c` child on a socket pair, not a
multiprocessing spawn, which would import the daemon's main module again. The child's start (importing torch for the forward check) has its
own, longer bound, outside the check's.

What crosses the pipe: the context's plain fields (paths, settings, the manifest, the header table)
to the child, the check's detail, failure and the parsed table back; pickled, between this process
and its own child. A staged copy (`ctx.staged`) crosses to the forward check when it can be opened
without copying its bytes (`shareable`: a CUDA copy as torch's IPC handle, the loader's buffer as
its descriptor), so the canary reads the hashed bytes at device speed, as it would in this process
(issue 41); otherwise the child reads the weights itself. A child killed mid-check leaves a shared
CUDA copy's memory held until the daemon exits (torch frees it only when every opener let go).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from daemon.checks.base import CheckContext, CheckFailed, CheckSkipped, deferred_for_memory, memory_short

ISOLATED: tuple[str, ...] = ("headers", "compat", "forward")
START_LIMIT_S = 600.0  # the child's start and imports (torch: half a minute or more on a busy host)
# imported when a child starts (outside any check's limit): a check's first run pays no import
CHEAP_IMPORTS = ("daemon.checks.lookup", "daemon.checks.headers", "daemon.checks.compat", "daemon.checks.adapter",
                 "safetensors")  # fmt: skip
FORWARD_IMPORTS = ("torch", "safetensors.torch", "transformers", "daemon.checks.forward")
_CTX_FIELDS = ("directory", "reference", "manifest", "recorded", "files", "file_list_from", "hashed", "digest",
               "headers", "table")  # fmt: skip


class CheckProcessError(Exception):
    """The child died or did not start: the check fails with this reason."""


class CheckProcess:
    """One child process that runs the isolated checks, one at a time, each under a deadline."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self.beat: Callable[[], object] | None = None  # the watchdog ping, called while waiting
        self.beat_s = 5.0
        self.starts = 0  # children started (a killed one is replaced by the next check)
        self.running: str | None = None  # the check in the child now
        self._premapped = False  # the child was handed a premap it has not been told to let go

    def start(self, imports: tuple[str, ...] = ()) -> None:
        """Start the child now (the daemon's warm-up) and wait for its imports."""
        with self._lock:
            self._ensure(imports)

    def run(self, name: str, adapter: bool, ctx: CheckContext, limit_s: float) -> dict[str, Any]:
        """Run check `name` on `ctx` in the child: its detail, or CheckFailed/CheckSkipped as it
        raised them; CheckFailed naming the limit when it ran past `limit_s`."""
        with self._lock:
            imports = FORWARD_IMPORTS if name == "forward" else ()
            try:
                conn = self._ensure(imports)
                fields = {f: getattr(ctx, f) for f in _CTX_FIELDS}
                if name == "forward" and ctx.staged is not None and ctx.staged.shareable:
                    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)

                    # pickled apart: a copy the child cannot open costs a second read, not the check
                    fields["staged"] = bytes(ForkingPickler.dumps(ctx.staged))
                conn.send(("check", name, adapter, ctx.settings, fields))
            except (CheckProcessError, OSError) as exc:
                self._kill()
                raise CheckFailed(f"{name} check could not run in its process: {exc}") from None
            self.running = name
            try:
                answered = self._wait(conn, limit_s)
            finally:
                self.running = None
            if not answered:
                self._kill()
                raise CheckFailed(
                    f"{name} check ran past its time limit of {limit_s:g} s (checks.check_time_limit_s); "
                    "its process was killed", {"time_limit_s": limit_s, "timed_out": True})  # fmt: skip
            try:
                kind, payload, updates = conn.recv()
            except (EOFError, OSError):
                code = self._kill()
                raise CheckFailed(f"{name} check's process died (exit code {code})", {"exit_code": code}) from None
        ctx.headers, ctx.table = updates
        if kind == "failed":
            raise CheckFailed(payload[0], payload[1], deferred=payload[2])
        if kind == "skipped":
            raise CheckSkipped(*payload)
        if kind == "crashed":
            raise RuntimeError(payload)
        result: dict[str, Any] = payload
        return result

    def premap(self, token: object | None) -> None:
        """Hand the child a loader buffer to open now, before the forward check that reads it (a
        daemon.transport.ipc_verify.Premap: it opens where it is unpickled), or None: let go of
        one no check took. Never starts the child and never waits on a check in flight: a child
        not up, or busy, opens the buffer at the check, as without this."""
        if not self._lock.acquire(blocking=token is None):
            return
        try:
            conn = self._conn
            if conn is None or self._proc is None or self._proc.poll() is not None:
                return
            if token is not None:
                self._premapped = True
            elif not self._premapped:
                return
            else:
                self._premapped = False
            with contextlib.suppress(OSError):  # a dead child is found and replaced by the next check
                conn.send(("premap", None if token is None else bytes(ForkingPickler.dumps(token))))
        finally:
            self._lock.release()

    def stop(self) -> None:
        """End the child when no check is in flight. One in flight is left to finish (or meet its
        limit): killed now it would reject the checkpoint, which the next start verifies again; the
        child dies with this process anyway (PR_SET_PDEATHSIG, and its socket closes)."""
        if self._lock.acquire(timeout=0.5):
            try:
                self._kill()
            finally:
                self._lock.release()

    def _wait(self, conn: Connection, limit_s: float) -> bool:
        """True once an answer is waiting; False past `limit_s`. Pings `beat` meanwhile."""
        deadline = time.monotonic() + limit_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if conn.poll(min(left, self.beat_s)):
                return True
            if self.beat is not None:
                self.beat()

    def _ensure(self, imports: tuple[str, ...]) -> Connection:
        if self._proc is not None and self._proc.poll() is not None:
            self._kill()
        if self._proc is None or self._conn is None:
            ours, theirs = socket.socketpair()
            with ours, theirs:
                proc = subprocess.Popen(
                    [sys.executable, "-c", f"from daemon.checks.isolation import main; main({theirs.fileno()})"],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
                self._proc, self._conn = proc, Connection(os.dup(ours.fileno()))
            self.starts += 1
            self._ask(("import", (*CHEAP_IMPORTS, *imports)))
        elif imports:
            self._ask(("import", imports))
        return self._conn

    def _ask(self, request: tuple[Any, ...]) -> None:
        """Send an import request and wait for it, under START_LIMIT_S."""
        assert self._conn is not None
        self._conn.send(request)
        if not self._wait(self._conn, START_LIMIT_S):
            raise CheckProcessError(f"its start and imports took over {START_LIMIT_S:g} s")
        try:
            answer = self._conn.recv()
        except (EOFError, OSError):
            raise CheckProcessError(f"it exited while starting (exit code {self._kill()})") from None
        if answer[0] != "imported":
            raise CheckProcessError(f"importing failed: {answer[1]}")

    def _kill(self) -> int | None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing it started outlives it
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10.0)
        return proc.returncode


def main(fd: int) -> None:
    """The child: answer each request on socket `fd` until it closes."""
    import ctypes
    import importlib

    with contextlib.suppress(OSError, AttributeError):  # Linux: killed with the daemon, even mid-check
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    conn = Connection(fd)
    premapped: Any = None  # a loader buffer opened ahead of the check that will read it

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if request[0] == "premap":  # unanswered: the parent does not wait for it
            if premapped is not None:
                _release(premapped, "discard")
            premapped = None
            if request[1] is not None:
                with contextlib.suppress(Exception):  # then the check opens the buffer itself
                    premapped = ForkingPickler.loads(request[1])
            continue
        if request[0] == "import":
            try:
                for module in request[1]:
                    importlib.import_module(module)
                conn.send(("imported", None))
            except Exception as exc:  # told to the parent, which fails the check with it
                conn.send(("import_failed", f"{type(exc).__name__}: {exc}"))
            continue
        from daemon.checks.lookup import resolve

        _op, name, adapter, settings, fields = request
        ctx = CheckContext(fields.pop("directory"), settings, fields.pop("reference"))
        staged = fields.pop("staged", None)
        for key, value in fields.items():
            setattr(ctx, key, value)
        began = time.perf_counter()
        if staged is not None:
            try:
                ctx.staged = ForkingPickler.loads(staged)
            except Exception:  # noqa: BLE001  (no IPC here, or the buffer is gone: the canary reads the files)
                ctx.staged = None
        # the child's share of a check's time, in its detail (issue 41: where the forward's time goes)
        timing = {"staged_open": _ms_since(began) if staged is not None else None}
        opened_ahead = bool(getattr(ctx.staged, "opened_ahead", False))  # taken from a premap
        answer: tuple[str, Any]
        try:
            answer = ("ok", resolve(name, adapter)(ctx))
        except CheckFailed as exc:
            answer = ("failed", (exc.reason, exc.detail, exc.deferred))
        except CheckSkipped as exc:
            answer = ("skipped", (exc.reason, exc.detail))
        except Exception as exc:  # noqa: BLE001  (answered: see crash_answer)
            answer = crash_answer(name, exc)
        finally:
            # the parent's own copy is let go before answering (the parent frees it next); a view of
            # the loader's buffer closes after it (the loader frees on its own accounting): its
            # synchronize and unmap, ~40 ms for 16 GB on an H100, are then off the update's path
            later = ctx.staged if ctx.staged is not None and ctx.staged.owned_elsewhere else None
            released = time.perf_counter()
            if ctx.staged is not None and later is None:
                _release(ctx.staged)
            ctx.staged = None
        if answer[0] == "ok" and isinstance(answer[1], dict) and staged is not None:
            timing.update(staged_release=_ms_since(released), child=_ms_since(began))
            answer[1].setdefault("child_ms", timing)
            answer[1].setdefault("staged_opened_ahead", opened_ahead)
        with contextlib.suppress(OSError):
            conn.send((*answer, (ctx.headers, ctx.table)))
        if later is not None:
            _release(later)


CHECK_PROCESS = CheckProcess()  # the daemon's one child for the isolated checks


def _ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 2)


def _release(staged: Any, how: str = "release") -> None:
    with contextlib.suppress(Exception):
        getattr(staged, how)()


def crash_answer(name: str, exc: Exception) -> tuple[str, Any]:
    """The child's answer for a check that raised: the runner records it as a crash, with the cause,
    except a host or device short of memory, which defers the version (daemon.checks.base)."""
    if memory_short(exc):
        failed = deferred_for_memory(name, exc)
        return "failed", (failed.reason, failed.detail, True)
    return "crashed", f"{type(exc).__name__}: {exc}"
