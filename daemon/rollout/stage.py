"""Turning a checkpoint into the update request the workers receive, by the configured transport.

`Stager` holds the daemon side of the transport named by `[rollout] transport` (from the
registry, daemon.transport) and asks it to `prepare` a verified checkpoint before any worker
leaves RUNNING (disk: its directory; ipc: stage it in the loader, then its descriptor). It never
asks which transport it holds. A `Target` is a version plus the request that carries it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.checks import VerifyStager
from daemon.common import get_logger
from daemon.engines import MapsAhead, ReadsAhead, WeightInfo, WorkerError
from daemon.registry import CheckpointRef, Journal
from daemon.rollout.states import WorkerHandle, WorkerSet
from daemon.transport import (
    DaemonTransport,
    Expect,
    ExpectedFile,
    Outgoing,
    SenderOptions,
    StageError,
    UpdateRequest,
    WorkersAhead,
    daemon_transport,
)

__all__ = ["StageError", "Stager", "Target", "WorkerAsks", "ask_to_map_ahead", "ask_to_read_ahead"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Target:
    """A version to put on a worker and the request that carries it (disk path or ipc descriptor)."""

    checkpoint: CheckpointRef
    request: UpdateRequest
    staged: bool = False  # the transport holds a staged copy of it

    @property
    def version(self) -> str:
        return self.checkpoint.version

    def matches(self, info: WeightInfo) -> bool:
        if info.version != self.checkpoint.version:
            return False
        return not (self.checkpoint.digest and info.digest and info.digest != self.checkpoint.digest)


# A rollout's first prepare waits at most this long for asks still on their way to a worker, so a
# prepare never overtakes the read-ahead it would take (a worker that hangs delays it this much).
ASK_SETTLE_S = 2.0
Ask = tuple[str, str | None, Callable[[Any], None]]  # (what, version, the call on the worker's client)


class WorkerAsks:
    """What this host's workers are asked while a version is verified, so they start on it before
    its rollout: open its loader buffer (`map_ahead`, ipc: MapsAhead) or read its files
    (`read_ahead`, disk: ReadsAhead); a version of None lets go. Only capable workers are asked,
    in order, on a thread per worker: a slow or hung worker delays no other, and a let-go never
    overtakes the ask it answers. One that cannot takes no head start (it opens or reads at its
    prepare, as before)."""

    def __init__(self, fleet: WorkerSet) -> None:
        self.fleet = fleet
        self._queues: dict[str, queue.SimpleQueue[Ask]] = {}
        self._cond = threading.Condition()
        self._pending = 0

    def map_ahead(self, version: str | None, loader: str | None) -> None:
        self._each(MapsAhead, "map_ahead", version, lambda c: c.map_ahead(version, loader))

    def read_ahead(self, version: str | None, path: str | None, alg: str | None, nbytes: int = 0) -> None:
        """Each worker's read-ahead buffer leaves room (`reserve`) for the other workers' buffers
        and for the checks' staged copy, all of `nbytes`, as if they were on its device: the asks
        go out at once, so no worker can count on seeing the others' allocations (issue 41: on an
        80 GB H100 two read-aheads took the memory the forward check needed)."""
        asked = sum(isinstance(h.client, ReadsAhead) for h in self.fleet)
        reserve = nbytes * asked  # (asked - 1) other workers + the checks' copy
        self._each(ReadsAhead, "read_ahead", version, lambda c: c.read_ahead(version, path, alg, reserve))

    def settle(self, timeout: float) -> bool:
        """Wait until every ask made so far was answered (or failed); False after `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def _each(self, capability: type, what: str, version: str | None, call: Callable[[Any], None]) -> None:
        for h in self.fleet:
            if isinstance(h.client, capability):
                with self._cond:
                    self._pending += 1
                    q = self._queues.get(h.name)
                    if q is None:
                        q = self._queues[h.name] = queue.SimpleQueue()
                        threading.Thread(target=self._serve, args=(h, q), name=f"asks-{h.name}", daemon=True).start()
                q.put((what, version, call))

    def _serve(self, h: WorkerHandle, q: queue.SimpleQueue[Ask]) -> None:
        while True:
            what, version, call = q.get()
            try:
                call(h.client)
            except WorkerError as exc:
                log.info(f"{what}_not_taken", worker=h.name, version=version, error=str(exc))
            except Exception as exc:  # noqa: BLE001 - a head start lost; this worker's later asks still go
                log.warning(f"{what}_failed", worker=h.name, version=version, error=str(exc))
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()


def ask_to_map_ahead(fleet: WorkerSet) -> Callable[[str | None, str | None], None]:
    return WorkerAsks(fleet).map_ahead


def ask_to_read_ahead(fleet: WorkerSet) -> Callable[[str | None, str | None, str | None, int], None]:
    return WorkerAsks(fleet).read_ahead


def registry_expect(journal: Journal, ckpt: CheckpointRef) -> Expect:
    """What the registry verified for `ckpt`: content digest, tensor count, per-file digests."""
    files = []
    for path, size, crc, alg, digest in journal.verified_files(ckpt.id):
        digests = {k: v for k, v in (("crc32c", crc), (alg or "", digest)) if k and v}
        files.append(ExpectedFile(path, size, digests))
    return Expect(digest=ckpt.digest, tensors=ckpt.tensor_count, files=tuple(files))


class Stager:
    def __init__(
        self,
        transport_name: str,
        options: SenderOptions,
        transport: DaemonTransport | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.transport_name = transport_name
        self.sender = transport or daemon_transport(transport_name, options)
        self.journal = journal  # where the verified per-file digests come from (check while loading)
        # asks the host's workers to open (ipc) or read (disk) a version while it is verified
        self.asks: WorkerAsks | None = None

    @property
    def transport(self) -> str:
        return self.transport_name

    def target(self, ckpt: CheckpointRef) -> Target:
        """Raises StageError when the checkpoint cannot be offered (no local copy, loader refused).

        Every request carries the registry's per-file digests (`expect.files`): workers and the
        loader check the bytes they read against them, whatever the path (rollout, rollback,
        restore, recovery)."""
        if self.asks is not None and not self.asks.settle(ASK_SETTLE_S):
            log.info("asks_unsettled", version=ckpt.version, waited_s=ASK_SETTLE_S)
        expect = Expect(digest=ckpt.digest, tensors=ckpt.tensor_count, files=self.expected_files(ckpt))
        prepared = self.sender.prepare(Outgoing(ckpt.version, ckpt.local_path, expect))
        return Target(ckpt, prepared.request, prepared.staged)

    def expected_files(self, ckpt: CheckpointRef) -> tuple[ExpectedFile, ...]:
        return registry_expect(self.journal, ckpt).files if self.journal is not None else ()

    def verify_stager(self, version: str, device: str) -> VerifyStager | None:
        """Where the verify stage's crc32c pass stages `version` when the transport has a staging
        area of its own (ipc: the loader), so the bytes are read once; on disk, what asks the
        workers to read it while it is verified; None otherwise."""
        make = getattr(self.sender, "verify_stager", None)
        workers = WorkersAhead(self.asks.map_ahead, self.asks.read_ahead) if self.asks is not None else None
        return make(version, device, workers=workers) if callable(make) else None

    def retain(self, versions: set[str]) -> None:
        """Free what no worker can need any more (everything but serving and last_good)."""
        self.sender.retain(versions)

    def close(self) -> None:
        self.sender.close()
