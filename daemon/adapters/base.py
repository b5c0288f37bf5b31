"""The one interface the rollout engine uses to drive any worker.

Every adapter (builtin, sglang, vllm) implements `WorkerClient`; the rollout
engine never speaks HTTP itself. Calls raise `WorkerError` subclasses with a
message naming the worker and the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

TransportName = Literal["disk", "ipc", "broadcast"]
UpdateMode = Literal["copy", "swap"]


class WorkerError(RuntimeError):
    """A worker call failed (refused, timed out, or the worker is unreachable)."""


class WorkerUnreachable(WorkerError):
    """No answer from the worker at all: connection refused, reset or timed out."""


class UpdateRefused(WorkerError):
    """The worker answered and refused the update; its weights are unchanged."""


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
class UpdateRequest:
    version: str
    transport: TransportName = "disk"
    path: str | None = None  # disk: checkpoint directory
    descriptor: dict[str, Any] | None = None  # ipc: loader's JSON descriptor
    mode: UpdateMode = "copy"
    expect_digest: str | None = None
    expect_tensors: int | None = None


@dataclass(slots=True)
class UpdateResult:
    version: str
    duration_ms: float
    detail: dict[str, Any] = field(default_factory=dict)


class WorkerClient(Protocol):
    name: str

    def health(self) -> bool: ...
    def ready(self) -> bool: ...
    def weight_info(self) -> WeightInfo: ...
    def drain(self, timeout_s: float) -> None: ...
    def pause(self, mode: Literal["keep", "wait"] = "keep") -> None: ...
    def resume(self) -> None: ...
    def update(self, request: UpdateRequest) -> UpdateResult: ...
    def rollback(self) -> UpdateResult: ...
    def probe(self) -> str: ...  # one short greedy generation; returns the served weight_version
    def counters(self) -> dict[str, int]: ...  # requests_total, requests_failed
    def close(self) -> None: ...
