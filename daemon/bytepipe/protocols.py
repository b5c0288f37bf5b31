"""The shapes of a staged copy and of a stager, without torch: what the checks read and what the
caller that stages for them provides (the ipc loader's stager: daemon.transport.ipc_verify)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from daemon.hashing import FileDigest
from daemon.manifest import ManifestFile

__all__ = ["Staged", "VerifyStager"]


class Staged(Protocol):
    """A checkpoint's bytes staged by the crc32c pass (daemon.bytepipe.staged.StagedCopy)."""

    device: str

    @property
    def nbytes(self) -> int: ...

    def release(self) -> None: ...


class VerifyStager(Protocol):
    """Where the crc32c pass stages the weight files instead of this process (the ipc loader:
    daemon.transport.ipc_verify.LoaderStager); run_checks calls `finish` once the checks are over."""

    def stage(self, root: Path, rels: list[str], alg: str) -> tuple[list[FileDigest], Staged] | None: ...

    def finish(self, ok: bool, files: list[ManifestFile], digest: str | None) -> None: ...
