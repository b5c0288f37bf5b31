"""The one interface the rollout engine uses to drive any worker, and what a worker can do.

Every engine client (builtin, vLLM, SGLang) implements `WorkerClient`; the rollout engine never
speaks HTTP itself and never asks which client it holds: it reads
`capabilities`. The daemon owns each worker's state (the `workers` table, moved only by the
state machine in daemon.rollout); a client only carries calls. Going back to an earlier
version is `rollback(request)`: the daemon passes the update request of the version to go back
to, so no engine client has to keep previous weights. A worker that does keep them
(`restores_itself`) may also be asked to `restore()` them by itself, e.g. after a failed write.

A trainer's broadcast (daemon.controller.broadcast) takes only workers whose client declares
`capabilities.broadcast`: those join the trainer's torch.distributed group through the public
`init_weight_group`; every other client refuses that call with a WorkerError.

Calls raise `WorkerError` subclasses with a message naming the worker and the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from daemon.transport import Expect, GroupSpec, UpdateMode, UpdateRequest

PauseMode = Literal["keep", "wait"]  # keep: requests stay queued; wait: active ones finish first

__all__ = ["AdapterRequest", "AdapterResult", "Capabilities", "NonFiniteOutput", "PauseMode", "PeerNotVerified",
           "MapsAhead", "PreparesUpdates", "ServedAdapter", "ServesAdapters", "Timeouts", "UpdateMode", "UpdateRefused",
           "UpdateRequest", "UpdateResult",
           "WeightInfo", "WorkerClient", "WorkerError", "WorkerUnreachable", "cannot_broadcast", "read_token"]  # fmt: skip


class WorkerError(RuntimeError):
    """A worker call failed (refused, timed out, or the worker is unreachable)."""


class WorkerUnreachable(WorkerError):
    """No answer from the worker at all: connection refused, reset or timed out."""


class PeerNotVerified(WorkerUnreachable):
    """The peer at the worker's address could not prove it holds the worker's launch secret
    (daemon/common/identity.py): it may be another process on the port. Nothing secret was sent to it."""


def cannot_broadcast(worker: str, engine: str) -> WorkerError:
    """What `init_weight_group` raises on a client without `capabilities.broadcast`."""
    return WorkerError(f"worker {worker}: init_weight_group: a {engine} worker cannot join a trainer's broadcast "
                       "(no capabilities.broadcast; the reference worker can)")


class NonFiniteOutput(WorkerError):
    """The worker answered, and its logits were not finite: a fault of the weights it serves."""


class UpdateRefused(WorkerError):
    """The worker answered and refused the update; its weights are unchanged."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a worker's engine can do; the rollout engine plans by these flags, never by kind."""

    pause_modes: tuple[PauseMode, ...] = ()  # how it can hold requests during an update; () = cannot pause
    can_drain: bool = False  # readiness off, then in-flight requests finish (bounded wait)
    transports: tuple[str, ...] = ("disk",)  # update transports it accepts (names in daemon.transport)
    restores_itself: bool = False  # keeps its last good weights and can `restore()` them alone
    atomic_updates: bool = False  # a failed update leaves the previous weights (else the worker is UNCERTAIN)
    reports_in_flight: bool = False  # weight_info().in_flight counts the requests it is serving
    # LoRA adapters served by request `model` name (the client implements `ServesAdapters`)
    adapters: bool = False
    # a new version replaces a served name in one step, between requests (else: unload, then load)
    adapter_swap_atomic: bool = False
    # joins a trainer's torch.distributed group (`init_weight_group`) and takes the `broadcast` transport
    broadcast: bool = False


@dataclass(frozen=True, slots=True)
class Timeouts:
    request_s: float = 10.0  # every call without its own
    update_s: float = 300.0  # the transfer into the worker's parameters
    drain_s: float = 30.0  # in-flight requests finishing


@dataclass(slots=True)
class WeightInfo:
    version: str | None
    digest: str | None
    state: str
    in_flight: int = 0
    tensors: int = 0
    bytes: int = 0
    device: str = "cpu"
    update_count: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class UpdateResult:
    version: str
    duration_ms: float
    detail: dict[str, Any] = field(default_factory=dict)


class WorkerClient(Protocol):
    name: str
    capabilities: Capabilities

    def health(self) -> bool: ...
    def ready(self) -> bool: ...
    def weight_info(self) -> WeightInfo: ...
    def drain(self, timeout_s: float) -> None: ...
    def pause(self, mode: PauseMode = "keep") -> None: ...
    def resume(self) -> None: ...
    def update(self, request: UpdateRequest) -> UpdateResult: ...
    def rollback(self, request: UpdateRequest) -> UpdateResult:
        """Back to an earlier version: install the update request the daemon kept for it."""
        ...

    def restore(self) -> UpdateResult:
        """Back to the weights the worker retained by itself (only with `restores_itself`)."""
        ...

    def init_weight_group(self, spec: GroupSpec, timeout_s: float) -> None:
        """Join a trainer's weight group before a `broadcast` update (only with
        `capabilities.broadcast`; other clients raise WorkerError saying they cannot)."""
        ...

    def probe(self) -> str: ...  # one short greedy generation; returns the served weight_version
    def counters(self) -> dict[str, int]: ...  # requests_total, requests_failed
    def close(self) -> None: ...


@runtime_checkable
class PreparesUpdates(Protocol):
    """Optional: the worker can open and validate an update's source while it still serves
    (`prepare(request)`, before the pause), so the update itself only writes."""

    def prepare(self, request: UpdateRequest) -> None: ...


@runtime_checkable
class MapsAhead(Protocol):
    """Optional: the worker can open a version's loader buffer while the daemon still verifies it
    (`map_ahead(version, loader)`, answered at once), so its prepare finds the buffer open;
    `map_ahead(None, None)` lets go of it (the version failed its checks)."""

    def map_ahead(self, version: str | None, loader: str | None) -> None: ...


@runtime_checkable
class ReadsAhead(Protocol):
    """Optional: the worker can read a disk version into a buffer of its own while the daemon
    still verifies it, hashing each file with `alg` (`read_ahead(version, path, alg, reserve)`,
    answered at once), only when its device keeps `reserve` bytes free beside the buffer; its
    prepare takes that buffer when the digests are the verified ones.
    `read_ahead(None, None, None)` lets go of it (the version failed its checks)."""

    def read_ahead(self, version: str | None, path: str | None, alg: str | None, reserve: int = 0) -> None: ...


@runtime_checkable
class ResumesAfterUpdate(Protocol):
    """Optional: from PAUSED/DRAINING the worker writes, resumes at once and then probes serving
    (`update_and_resume(request)`, one call: the pause window is the write alone). The answer's
    detail carries `probe` and `pause_window_ms`; a failed probe flips the worker back to what it
    served and is raised as UpdateRefused (it is RUNNING on the previous version)."""

    def update_and_resume(self, request: UpdateRequest) -> UpdateResult: ...


@dataclass(frozen=True, slots=True)
class AdapterRequest:
    """One LoRA adapter version to serve under `name` (a verified PEFT directory)."""

    name: str  # what clients send as `model`
    version: str
    path: str
    expect: Expect = field(default_factory=Expect)  # the verified digests the engine's files must match
    replace: bool = False  # the worker serves another version of `name` now


@dataclass(slots=True)
class AdapterResult:
    name: str
    version: str
    duration_ms: float
    tokens: list[int] | None = None  # the worker's own greedy probe under the adapter, when it ran one
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    name: str
    version: str | None  # None: the engine knows only the directory (the daemon maps it to a version)
    path: str | None


@runtime_checkable
class ServesAdapters(Protocol):
    """LoRA adapters by name beside the base (with `capabilities.adapters`); nothing is paused.
    Errors: UpdateRefused (refused, the name serves what it did), WorkerError otherwise."""

    def load_adapter(self, request: AdapterRequest) -> AdapterResult: ...
    def unload_adapter(self, name: str) -> None: ...
    def adapters(self) -> dict[str, ServedAdapter]: ...
    def adapter_probe(self, name: str) -> tuple[str | None, list[int]]:
        """One greedy generation with `model: name`: (the version it ran under if the engine
        says, its tokens); NonFiniteOutput when its logits were not finite."""
        ...

    def adapter_counters(self, name: str) -> dict[str, int] | None:
        """requests_total / requests_failed of that adapter's requests; None: the engine has none."""
        ...


class ClientFactory(Protocol):
    """What the registry names for a kind: builds the client for one configured worker."""

    def __call__(self, name: str, url: str, *, token_file: str | None, timeouts: Timeouts) -> WorkerClient: ...


def read_token(token_file: str | Path | None, worker: str) -> str | None:
    """The bearer token from `token_file` (first line, stripped); None when no file is configured."""
    if not token_file:
        return None
    path = Path(token_file).expanduser()
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise WorkerError(f"worker {worker}: cannot read token file {token_file}: {exc.strerror}") from None
    return token or None
