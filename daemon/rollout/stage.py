"""Turning a checkpoint into the update request the workers receive, by the configured transport.

disk: the verified checkpoint's local directory.
ipc:  the loader stages the version once (`LoaderClient.stage`) before any worker
      leaves RUNNING; workers get its JSON descriptor and open the buffer themselves.
"""

from __future__ import annotations

from typing import Any

from daemon.adapters.base import UpdateRequest
from daemon.logging import get_logger
from daemon.rollout.driver import Target
from daemon.rollout.journal import CheckpointRef
from daemon.rollout.settings import RolloutSettings

log = get_logger(__name__)


class StageError(RuntimeError):
    """The checkpoint cannot be offered to workers (no local copy, loader refused)."""


class Stager:
    def __init__(self, settings: RolloutSettings, loader: Any | None = None) -> None:
        self.settings = settings
        self.loader = loader  # daemon.loader.client.LoaderClient when transport = "ipc"
        self._staged: set[str] = set()

    @property
    def transport(self) -> str:
        return self.settings.transport

    def target(self, ckpt: CheckpointRef) -> Target:
        if not ckpt.local_path:
            raise StageError(f"{ckpt.version}: no local copy to deploy from")
        common: dict[str, Any] = {
            "version": ckpt.version,
            "expect_digest": ckpt.digest,
            "expect_tensors": ckpt.tensor_count,
        }
        if self.settings.transport == "disk":
            return Target(ckpt, UpdateRequest(transport="disk", path=ckpt.local_path, mode="copy", **common))
        if self.loader is None:
            raise StageError("transport = \"ipc\" needs a [loader] (socket of `hotswap loader`)")
        from daemon.loader.client import LoaderError

        try:
            if ckpt.version not in self._staged:
                info = self.loader.stage(ckpt.version, ckpt.local_path, digest=ckpt.digest)
                log.info("staged", version=ckpt.version, bytes=info.bytes, seconds=info.seconds, devices=info.devices)
                self._staged.add(ckpt.version)
            descriptor = self.loader.descriptor(ckpt.version)
        except LoaderError as exc:
            self._staged.discard(ckpt.version)
            raise StageError(f"{ckpt.version}: staging in the loader failed: {exc}") from exc
        return Target(
            ckpt,
            UpdateRequest(transport="ipc", descriptor=descriptor, mode=self.settings.update_mode, **common),
        )

    def retain(self, versions: set[str]) -> None:
        """Free staged versions no worker can need any more (everything but serving and last_good)."""
        if self.loader is None:
            return
        from daemon.loader.client import LoaderError

        for version in sorted(self._staged - versions):
            try:
                self.loader.drop(version)
                self._staged.discard(version)
            except LoaderError as exc:
                log.warning("loader_drop_failed", version=version, error=str(exc))
