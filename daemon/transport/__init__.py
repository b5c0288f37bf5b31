"""Weight transports, chosen by name: one row per transport names its daemon side and its worker side.

    TRANSPORTS       name -> TransportEntry(daemon side, worker side, stages)
    daemon_transport(name, options) -> DaemonTransport   (the rollout's Stager holds one)
    worker_transport(request, store) -> WorkerTransport  (the worker's update path builds one per update)

Interfaces: `daemon.transport.base`. Today: disk (`disk.py`: the directory is the request,
written in place by the reader threads of `disk_read.py`, on the byte pipeline `daemon.bytepipe`)
and ipc (`ipc_stage.py` stages in the loader and hands out its descriptor, `ipc_verify.py` stages
for the daemon's verify there; `ipc.py` opens it in the worker, through the buffer cache of
`ipc_open.py`, and copies or swaps). The loader's client and the descriptor are in `daemon.handoff`.

How to add a transport (e.g. `broadcast`): write `daemon/transport/broadcast.py` with a daemon
side (a class taking `SenderOptions`, with `name`, `prepare`, `retain`, `close`) and a worker
side (a factory `(request, store) -> WorkerTransport`; add `open()` or `lease()` if it can open
before the pause or be swapped in), then add one row here:
`"broadcast": TransportEntry("daemon.transport.broadcast:BroadcastSender",
"daemon.transport.broadcast:open_update")`. Config validation (`[rollout] transport`), the
rollout's stager, the worker's `/admin/update` and the engine clients' capability lists read this table.

Entries are imported by name when first used, so the daemon never imports the worker sides
(torch) and the worker never imports the daemon sides.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from daemon import public_face
from daemon.transport.base import (
    DaemonTransport,
    DaemonTransportFactory,
    SenderOptions,
    UpdateRequest,
    WorkerTransport,
    WorkerTransportFactory,
)

if TYPE_CHECKING:
    from daemon.transport.base import (
        TORCH_TO_ST,
        BadUpdateRequest,
        Expect,
        ExpectedFile,
        OpensBeforePause,
        Outgoing,
        PlansCopies,
        SourceChanged,
        StageError,
        StagesAhead,
        SwapCapable,
        SwapLease,
        TableMismatch,
        TransportError,
        UpdateMode,
        WorkersAhead,
        check_table,
    )
    from daemon.transport.broadcast import (
        DEFAULT_BUCKET_BYTES,
        buckets,
        parse_table,
        session_message,
        table_to_json,
        total_bytes,
    )
    from daemon.transport.broadcast_worker import bucket_broadcast, join, tensors_digest, vote
    from daemon.transport.check import Reference, files_problem, load_expect_file, reference_for
    from daemon.transport.disk import DiskTransport
    from daemon.transport.group_spec import GroupSpec
    from daemon.transport.ipc import map_ahead
    from daemon.transport.ipc_open import OPENER, TRUSTED_UIDS


@dataclass(frozen=True, slots=True)
class TransportEntry:
    daemon_side: str  # "module:attr" of a DaemonTransportFactory
    worker_side: str  # "module:attr" of a WorkerTransportFactory
    stages: bool = False  # it stages a copy (GPU or shared memory): verification checks that headroom too


TRANSPORTS: dict[str, TransportEntry] = {
    "disk": TransportEntry("daemon.transport.disk:DiskSender", "daemon.transport.disk:open_update"),
    "ipc": TransportEntry("daemon.transport.ipc_stage:IpcSender", "daemon.transport.ipc:open_update", stages=True),
    "broadcast": TransportEntry("daemon.transport.broadcast:BroadcastSender", "daemon.transport.broadcast_worker:open_update"),
}


def _resolve(target: str) -> Any:
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def daemon_transport(name: str, options: SenderOptions) -> DaemonTransport:
    factory = cast(DaemonTransportFactory, _resolve(TRANSPORTS[name].daemon_side))
    return factory(options)


def worker_transport(request: UpdateRequest, store: Any) -> WorkerTransport:
    """Build the worker side for `request` (its name must be in TRANSPORTS; the caller checks)."""
    factory = cast(WorkerTransportFactory, _resolve(TRANSPORTS[request.transport].worker_side))
    return factory(request, store)


__all__ = [
    "BadUpdateRequest", "DEFAULT_BUCKET_BYTES", "DaemonTransport", "DaemonTransportFactory",
    "DiskTransport", "Expect", "ExpectedFile", "GroupSpec", "OPENER", "OpensBeforePause", "Outgoing",
    "PlansCopies", "Reference", "SenderOptions", "SourceChanged", "StageError", "StagesAhead",
    "SwapCapable", "SwapLease", "TORCH_TO_ST", "TRANSPORTS", "TRUSTED_UIDS", "TableMismatch",
    "TransportEntry", "TransportError", "UpdateMode", "UpdateRequest", "WorkerTransport",
    "WorkerTransportFactory", "WorkersAhead", "bucket_broadcast", "buckets", "check_table", "daemon_transport",
    "files_problem", "join", "load_expect_file", "map_ahead", "parse_table", "reference_for", "session_message",
    "table_to_json", "tensors_digest", "total_bytes", "vote", "worker_transport"
]

__getattr__ = public_face(__name__)
