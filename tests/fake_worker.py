"""`FakeWorkerClient`: an in-memory `WorkerClient` for fast tests of the rollout engine, driver,
recovery and health window. It keeps a state and a version like the reference worker does, and
can be told to fail at any step, once or every time:

    w = FakeWorkerClient("w0", version="v0")
    w.fail("update", UpdateRefused("worker w0: update: HTTP 409: shape"))  # refused, weights unchanged
    w.fail("update", crash=True)        # the process dies mid-call: every later call is unreachable
    w.fail("update", partial=True)      # a non-atomic engine: half the tensors written, then an error
    w.fail("probe", served="other")     # the probe generation answers with another version

`Restarts` stands in for the restart command: `restart()` brings a crashed fake back on the
fallback version. Registered in `daemon.engines.WORKER_KINDS` as kind "fake" by the tests that
build a whole `RolloutService` (see `connect`): that is all a new worker kind needs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from daemon.config import WorkerSpec
from daemon.engines.base import (
    Capabilities,
    PauseMode,
    Timeouts,
    UpdateRefused,
    UpdateRequest,
    UpdateResult,
    WeightInfo,
    WorkerError,
    WorkerUnreachable,
)
from daemon.registry.journal import CheckpointRef

MIXED = "<partly v?>"  # what a non-atomic engine serves after a partial write


@dataclass
class _Failure:
    exc: Exception | None = None
    crash: bool = False
    partial: bool = False
    served: str | None = None
    times: int = 1


class FakeWorkerClient:
    def __init__(
        self,
        name: str,
        version: str | None = "v0",
        digest: str | None = None,
        *,
        atomic: bool = True,
        restores_itself: bool = True,
        pause_modes: tuple[PauseMode, ...] = ("keep", "wait"),
        can_drain: bool = True,
    ) -> None:
        self.name = name
        self.capabilities = Capabilities(pause_modes=pause_modes, can_drain=can_drain, transports=("disk", "ipc"),
                                         restores_itself=restores_itself, atomic_updates=atomic,
                                         reports_in_flight=True)  # fmt: skip
        self.state = "RUNNING"
        self.boot = version  # what its process serves when it starts (a restart without a fallback)
        self.version, self.digest = version, digest
        self.previous: tuple[str | None, str | None] | None = None
        self.alive = True
        self.calls: list[str] = []
        self.requests_total = 0
        self.requests_failed = 0
        self._failures: dict[str, list[_Failure]] = defaultdict(list)

    # -- test controls -----------------------------------------------------------------------
    def fail(self, step: str, exc: Exception | None = None, *, crash: bool = False, partial: bool = False,
             served: str | None = None, times: int = 1) -> None:  # fmt: skip
        self._failures[step].append(_Failure(exc, crash, partial, served, times))

    def revive(self, version: str | None, digest: str | None = None) -> None:
        """The process came back (restart command): RUNNING on `version`, else on what it boots."""
        self.alive, self.state, self.previous = True, "RUNNING", None
        self.version, self.digest = (version, digest) if version is not None else (self.boot, None)

    def traffic(self, total: int, failed: int = 0) -> None:
        self.requests_total += total
        self.requests_failed += failed

    def _enter(self, step: str) -> _Failure | None:
        self.calls.append(step)
        if not self.alive:
            raise WorkerUnreachable(f"worker {self.name}: {step}: no answer (process gone)")
        queue = self._failures.get(step)
        if not queue:
            return None
        f = queue[0]
        f.times -= 1
        if f.times <= 0:
            queue.pop(0)
        if f.crash:
            self.alive = False
            raise WorkerUnreachable(f"worker {self.name}: {step}: connection reset")
        if f.partial:
            self.version, self.digest = MIXED, None
            raise WorkerError(f"worker {self.name}: {step}: HTTP 500: write failed half way")
        if f.exc is not None:
            raise f.exc
        return f

    # -- WorkerClient ------------------------------------------------------------------------
    def health(self) -> bool:
        return self.alive

    def ready(self) -> bool:
        return self.alive and self.state == "RUNNING"

    def weight_info(self) -> WeightInfo:
        self._enter("weight_info")
        return WeightInfo(self.version, self.digest, self.state, extra={"requests_total": self.requests_total,
                                                                        "requests_failed": self.requests_failed})  # fmt: skip

    def drain(self, timeout_s: float) -> None:
        self._enter("drain")
        if self.state not in ("RUNNING", "DRAINING"):
            raise UpdateRefused(f"worker {self.name}: drain: cannot drain in state {self.state}")
        self.state = "DRAINING"

    def pause(self, mode: PauseMode = "keep") -> None:
        self._enter("pause")
        if self.state not in ("RUNNING", "PAUSED"):
            raise UpdateRefused(f"worker {self.name}: pause: cannot pause in state {self.state}")
        self.state = "PAUSED"

    def resume(self) -> None:
        self._enter("resume")
        if self.state == "UNHEALTHY":
            raise WorkerError(f"worker {self.name}: resume: HTTP 503: unhealthy")
        self.state = "RUNNING"

    def update(self, request: UpdateRequest) -> UpdateResult:
        self._enter("update")
        return self._install(request)

    def rollback(self, request: UpdateRequest) -> UpdateResult:
        self._enter("rollback")
        return self._install(request)

    def _install(self, request: UpdateRequest) -> UpdateResult:
        if self.state == "UNHEALTHY":
            raise WorkerError(f"worker {self.name}: update: HTTP 503: unhealthy")
        self.previous = (self.version, self.digest)
        self.version, self.digest = request.version, request.expect.digest
        if self.state in ("DRAINING", "PAUSED", "UPDATED"):
            self.state = "UPDATED"
        return UpdateResult(request.version, 1.0, {"transport": request.transport})

    def restore(self) -> UpdateResult:
        self._enter("restore")
        if not self.capabilities.restores_itself or self.previous is None:
            raise WorkerError(f"worker {self.name}: rollback: nothing retained")
        (self.version, self.digest), self.previous = self.previous, (self.version, self.digest)
        if self.state == "UNHEALTHY":
            self.state = "RUNNING"
        return UpdateResult(self.version or "", 1.0, {})

    def probe(self) -> str:
        f = self._enter("probe")
        if f is not None and f.served is not None:
            return f.served
        return self.version or ""

    def counters(self) -> dict[str, int]:
        self._enter("counters")  # its own step name, so a test can fail only the health window's reads
        info = self.weight_info()
        return {"requests_total": int(info.extra["requests_total"]), "requests_failed": int(info.extra["requests_failed"])}

    def close(self) -> None:
        self.calls.append("close")


# The fakes a test built, by worker name: `connect` hands them to the daemon's code.
FAKES: dict[str, FakeWorkerClient] = {}


def connect(name: str, url: str, *, token_file: str | None, timeouts: Timeouts) -> FakeWorkerClient:
    """The registry factory for kind "fake" (`WORKER_KINDS["fake"] = "fake_worker:connect"`)."""
    return FAKES[name]


@dataclass
class Restarts:
    """Stands in for `daemon.rollout.managed.Restarter`: a restart brings the fake back on the fallback."""

    clients: dict[str, FakeWorkerClient]
    refuse: set[str] = field(default_factory=set)  # workers whose restart command fails
    done: list[str] = field(default_factory=list)

    def restart(self, spec: WorkerSpec, url: str, managed: Any, fallback: CheckpointRef | None) -> dict[str, Any]:
        if spec.name in self.refuse:
            return {"issued": False, "how": "command", "error": "restart command failed"}
        self.done.append(spec.name)
        self.clients[spec.name].revive(fallback.version if fallback else None, fallback.digest if fallback else None)
        return {"issued": True, "how": "fake restart", "version": fallback.version if fallback else None}
