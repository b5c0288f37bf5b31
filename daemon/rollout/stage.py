"""Turning a checkpoint into the update request the workers receive, by the configured transport.

`Stager` holds the daemon side of the transport named by `[rollout] transport` (from the
registry, daemon.transport) and asks it to `prepare` a verified checkpoint before any worker
leaves RUNNING (disk: its directory; ipc: stage it in the loader, then its descriptor). It never
asks which transport it holds. A `Target` is a version plus the request that carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.checks import VerifyStager
from daemon.engines import WeightInfo
from daemon.registry import CheckpointRef, Journal
from daemon.transport import (
    DaemonTransport,
    Expect,
    ExpectedFile,
    Outgoing,
    SenderOptions,
    StageError,
    UpdateRequest,
    daemon_transport,
)

__all__ = ["StageError", "Stager", "Target"]


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

    @property
    def transport(self) -> str:
        return self.transport_name

    def target(self, ckpt: CheckpointRef) -> Target:
        """Raises StageError when the checkpoint cannot be offered (no local copy, loader refused).

        Every request carries the registry's per-file digests (`expect.files`): workers and the
        loader check the bytes they read against them, whatever the path (rollout, rollback,
        restore, recovery)."""
        expect = Expect(digest=ckpt.digest, tensors=ckpt.tensor_count, files=self.expected_files(ckpt))
        prepared = self.sender.prepare(Outgoing(ckpt.version, ckpt.local_path, expect))
        return Target(ckpt, prepared.request, prepared.staged)

    def expected_files(self, ckpt: CheckpointRef) -> tuple[ExpectedFile, ...]:
        return registry_expect(self.journal, ckpt).files if self.journal is not None else ()

    def verify_stager(self, version: str, device: str) -> VerifyStager | None:
        """Where the verify stage's crc32c pass stages `version` when the transport has a staging
        area of its own (ipc: the loader), so the bytes are read once; None otherwise."""
        make = getattr(self.sender, "verify_stager", None)
        return make(version, device) if callable(make) else None

    def retain(self, versions: set[str]) -> None:
        """Free what no worker can need any more (everything but serving and last_good)."""
        self.sender.retain(versions)

    def close(self) -> None:
        self.sender.close()
