"""The two small interfaces every weight transport implements (httpx-style), and the request between them.

Daemon side, `DaemonTransport.prepare(version)` -> `Prepared`: turn a verified checkpoint into
the `UpdateRequest` every worker receives (disk: the directory; ipc: stage it in the loader once
and hand out its descriptor). It runs before any worker leaves RUNNING; `retain(versions)` frees
what no worker can need any more.

Worker side, `WorkerTransport`: opened on what a request names (a directory, a descriptor, a
process group), it reports the full tensor table *before* anything is written (`table()`), then
writes into parameters that already exist (`write_into`). The worker validates the table against
its live parameters with `check_table` first, so a mismatch is refused before a single parameter
changes. `source_digest()` is the content digest as the transport found it at its source (never
the sender's claim; the request's `expect` is what the worker compares it with); `stats()` says
what the transfer did; `close()` releases everything it opened. Optional capabilities, asked
with `isinstance`:

* `OpensBeforePause.open()`: acquire and map the source (IPC handles) before the worker pauses,
  so only `write_into` runs inside the pause window.
* `StagesAhead.stage(params)`: read (and check) the whole version into a private buffer now,
  while the worker serves (its `prepare`), so `write_into` inside the pause is a device copy of
  bytes already verified (disk: `daemon.transport.ahead`).
* `SwapCapable.lease(params)`: tensors the parameters may point at directly (swap mode: no copy;
  the previous version stays resident, so rollback is a pointer flip), validated against the
  live parameters, with a `release` for when no version record uses them any more.

Neither side ever asks which transport it holds; `daemon.transport.TRANSPORTS` names both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from daemon.bytepipe import BadUpdateRequest as BadUpdateRequest
from daemon.bytepipe import Expect as Expect
from daemon.bytepipe import ExpectedFile as ExpectedFile
from daemon.handoff import TensorSpec as TensorSpec

if TYPE_CHECKING:
    import torch

UpdateMode = Literal["copy", "swap"]

# safetensors dtype string <-> torch dtype name
ST_TO_TORCH: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
}
TORCH_TO_ST: dict[str, str] = {v: k for k, v in ST_TO_TORCH.items()}


class TableMismatch(ValueError):
    """The incoming tensor table does not match the live parameters; nothing was written."""


class TransportError(RuntimeError):
    """The transport failed while writing; the caller must restore the previous weights."""


class SourceChanged(TransportError):
    """The bytes read do not match their verified digests (the source changed since verify).
    The caller restores the previous weights; once it has, the update is refused for its data,
    which is not a failure of the worker (daemon.worker.updates.SourceRefused)."""


class StageError(RuntimeError):
    """The daemon side cannot offer a checkpoint to workers (no local copy, the loader refused).

    `infra`: the cause is not the checkpoint (the loader died or does not answer): its rollout
    fails without rejecting it, and is tried again (daemon.rollout.attribution)."""

    def __init__(self, message: str, *, infra: bool = False) -> None:
        super().__init__(message)
        self.infra = infra


# the envelope's own keys; every other key of an update body belongs to the transport
_ENVELOPE = ("version", "transport", "mode", "expect")


@dataclass(frozen=True, slots=True)
class UpdateRequest:
    """What a worker receives to install one version: a transport-neutral envelope plus the
    transport's own fields (`source`: disk {"path"}, ipc {"descriptor"}, ...).

    As JSON (the reference worker's `POST /admin/update` body) the source fields sit at the top
    level: `{version, transport, mode, expect: {digest, tensors, files}, path | descriptor | ...}`.
    """

    version: str
    transport: str = "disk"
    source: Mapping[str, Any] = field(default_factory=dict)
    mode: UpdateMode = "copy"
    expect: Expect = field(default_factory=Expect)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"version": self.version, "transport": self.transport, "mode": self.mode,
                                **{k: v for k, v in self.source.items() if k not in _ENVELOPE}}  # fmt: skip
        expect = self.expect.to_json()
        if expect:
            body["expect"] = expect
        return body

    @classmethod
    def from_json(cls, body: Any) -> UpdateRequest:
        """Parse the envelope (the transport checks its own fields when it is built)."""
        if not isinstance(body, dict):
            raise BadUpdateRequest("update body must be a JSON object")
        version = body.get("version")
        if not isinstance(version, str) or not version.strip():
            raise BadUpdateRequest("'version' must be a non-empty string")
        transport = body.get("transport", "disk")
        if not isinstance(transport, str):
            raise BadUpdateRequest("'transport' must be a string")
        mode = body.get("mode", "copy")
        if mode not in ("copy", "swap"):
            raise BadUpdateRequest(f"mode must be 'copy' or 'swap', not {mode!r}")
        source = {k: v for k, v in body.items() if k not in _ENVELOPE}
        return cls(version.strip(), transport, source, mode, Expect.from_json(body.get("expect")))


@dataclass(frozen=True, slots=True)
class Prepared:
    """A verified checkpoint made ready for workers by the daemon side of a transport."""

    request: UpdateRequest
    staged: bool = False  # the transport holds a staged copy of it (the checkpoint becomes `staged`)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What the daemon side is asked to prepare: a verified version and where its bytes are."""

    version: str
    local_path: str | None
    expect: Expect


@dataclass(frozen=True, slots=True)
class WorkersAhead:
    """How a sender's verify stager reaches this host's workers while a version is verified, so
    they start on it before the rollout: `map` (ipc: open the loader's buffer; (version, loader))
    and `read` (disk: read and hash the files; (version, path, alg, the version's bytes)); None:
    no worker asked. Called with a version of None, each lets go of what it took (the version failed)."""

    map: Callable[[str | None, str | None], None] | None = None
    read: Callable[[str | None, str | None, str | None, int], None] | None = None


@dataclass(frozen=True, slots=True)
class SenderOptions:
    """What a daemon side may need from the daemon's config (built by the rollout service)."""

    state_dir: Path
    update_mode: UpdateMode = "copy"
    request_timeout_s: float = 10.0
    stage_timeout_s: float = 600.0
    loader_socket: str = ""  # the staging loader's Unix socket; "" = <state_dir>/loader.sock


class DaemonTransport(Protocol):
    name: str

    def prepare(self, item: Outgoing) -> Prepared:
        """The request workers get for `item`; raises StageError. Called before any worker pauses."""
        ...

    def retain(self, versions: set[str]) -> None:
        """Free whatever is held for versions not in `versions` (serving and last good stay)."""
        ...

    def close(self) -> None: ...


DaemonTransportFactory = Callable[[SenderOptions], DaemonTransport]


class WorkerTransport(Protocol):
    name: str

    def table(self) -> dict[str, TensorSpec]:
        """Every tensor the source will deliver; reads headers/descriptors only."""
        ...

    def write_into(self, params: dict[str, torch.Tensor]) -> None:
        """Copy every tensor into the existing storage of `params` (same keys as table())."""
        ...

    def source_digest(self) -> str | None:
        """The content digest as found at the source (a manifest, the loader's staging); None if none."""
        ...

    def stats(self) -> dict[str, Any]:
        """Facts about the last transfer, merged into the update's answer (keys chosen by the transport)."""
        ...

    def close(self) -> None: ...


# Built by the worker for each update: (request, the worker's WeightStore) -> transport.
WorkerTransportFactory = Callable[[UpdateRequest, Any], WorkerTransport]


@runtime_checkable
class OpensBeforePause(Protocol):
    def open(self) -> None:
        """Acquire and map the source; raises (nothing written) when it cannot."""
        ...


@runtime_checkable
class PlansCopies(Protocol):
    def prepare_copy(self, params: dict[str, torch.Tensor]) -> None:
        """Before the pause: plan the copy into these parameters (and checksum the source), so
        the write inside the pause only copies and compares."""
        ...


@runtime_checkable
class StagesAhead(Protocol):
    def stage(self, params: dict[str, torch.Tensor]) -> None:
        """Read and check the source into a private buffer (or nothing, when it has no room);
        raises TransportError when the bytes do not match (nothing kept)."""
        ...


@dataclass
class SwapLease:
    """Validated (live parameter, tensor to point it at) pairs, and how to let the tensors go."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    release: Callable[[], None]


@runtime_checkable
class SwapCapable(Protocol):
    def lease(self, params: dict[str, torch.Tensor]) -> SwapLease:
        """Tensors `params` may point at for as long as the lease is not released; raises when a
        tensor does not fit its parameter (nothing changed)."""
        ...


def pair_up(params: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each live parameter with the tensor it would point at, refusing any that does not fit."""
    pairs = []
    for name, p in params.items():
        t = views[name]
        if p.shape != t.shape or p.dtype != t.dtype or p.device != t.device:
            raise TransportError(
                f"tensor {name!r}: cannot point live {p.dtype}{list(p.shape)}@{p.device} "
                f"at {t.dtype}{list(t.shape)}@{t.device}"
            )
        pairs.append((p, t))
    return pairs


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    dtype = TORCH_TO_ST[str(t.dtype).removeprefix("torch.")]
    return TensorSpec(name, dtype, tuple(t.shape), t.numel() * t.element_size())


def check_table(incoming: dict[str, TensorSpec], params: dict[str, torch.Tensor], limit: int = 5) -> None:
    """Raise TableMismatch listing the first differences between a source and live parameters."""
    problems: list[str] = []
    missing = sorted(set(params) - set(incoming))
    unexpected = sorted(set(incoming) - set(params))
    problems += [f"missing tensor {n!r}" for n in missing[:limit]]
    problems += [f"unexpected tensor {n!r}" for n in unexpected[:limit]]
    for name in sorted(set(params) & set(incoming)):
        want, got = spec_of(name, params[name]), incoming[name]
        if want.shape != got.shape:
            problems.append(f"tensor {name!r}: shape {list(got.shape)} != live {list(want.shape)}")
        elif want.dtype != got.dtype:
            problems.append(f"tensor {name!r}: dtype {got.dtype} != live {want.dtype}")
        elif want.nbytes != got.nbytes:
            problems.append(f"tensor {name!r}: {got.nbytes} bytes != live {want.nbytes}")
        if len(problems) >= limit:
            break
    if problems:
        extra = len(missing) + len(unexpected)
        raise TableMismatch("; ".join(problems[:limit]) + (f" (+{extra} more)" if extra > limit else ""))
