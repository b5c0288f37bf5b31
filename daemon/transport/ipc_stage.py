"""The ipc transport's daemon side: stage a verified version in the loader once, hand out its descriptor.

The loader (`hotswap loader`, daemon.loader) holds staged versions in GPU memory (shared host
memory without a GPU) and exports them as JSON descriptors; workers open them themselves
(`daemon.transport.ipc`). Staging happens before the first worker leaves RUNNING; versions no
worker can need any more (everything but serving and last good) are dropped from the loader.
"""

from __future__ import annotations

from typing import Any

from daemon.common import get_logger
from daemon.handoff import LoaderClient, LoaderError, LoaderUnavailable
from daemon.transport.base import (
    DaemonTransportFactory,
    Outgoing,
    Prepared,
    SenderOptions,
    StageError,
    UpdateRequest,
    WorkersAhead,
)
from daemon.transport.check import files_problem

log = get_logger(__name__)


class IpcSender:
    name = "ipc"

    def __init__(self, options: SenderOptions) -> None:
        self.options = options
        socket_path = options.loader_socket or str(options.state_dir / "loader.sock")
        self.loader = LoaderClient(socket_path, timeout=options.request_timeout_s, stage_timeout=options.stage_timeout_s)
        self._staged: set[str] = set()

    def prepare(self, item: Outgoing) -> Prepared:
        problem = files_problem(item.local_path, item.expect)  # never stage missing files
        if problem is not None:
            raise StageError(f"{item.version}: {problem}")
        assert item.local_path is not None
        try:
            if item.version not in self._staged:
                files = item.expect.to_json().get("files")  # the loader checks the bytes it stages
                info = self.loader.stage(item.version, item.local_path, digest=item.expect.digest, files=files)
                log.info("staged", version=item.version, bytes=info.bytes, seconds=info.seconds, devices=info.devices)
                self._staged.add(item.version)
            try:
                descriptor = self.loader.descriptor(item.version)
            except LoaderError as exc:
                if "not verified yet" not in str(exc):
                    raise
                # held back by a verify that never confirmed it (the daemon restarted): stage afresh
                self.loader.drop(item.version)
                files = item.expect.to_json().get("files")
                self.loader.stage(item.version, item.local_path, digest=item.expect.digest, files=files)
                self._staged.add(item.version)
                descriptor = self.loader.descriptor(item.version)
        except LoaderError as exc:
            self._staged.discard(item.version)
            # a loader that died or stopped answering mid-stage says nothing about the checkpoint
            raise StageError(f"{item.version}: staging in the loader failed: {exc}",
                             infra=isinstance(exc, LoaderUnavailable)) from exc  # fmt: skip
        # the verified directory too: an engine that cannot take the loader's buffer (a vLLM started
        # without hotswap's extension) reloads these files instead (daemon.engines.vllm)
        source = {"descriptor": descriptor, "path": item.local_path}
        request = UpdateRequest(item.version, "ipc", source, self.options.update_mode, item.expect)
        return Prepared(request, staged=True)

    def verify_stager(self, version: str, device: str, workers: WorkersAhead | None = None) -> Any:
        """For the daemon's verify: the crc32c pass stages `version` in the loader (one read);
        once verified it counts as staged here (prepare finds it, retain may drop it). `workers`:
        asks the host's workers to open its buffer while the checks run (LoaderStager)."""
        # imported here: it needs torch, which a daemon without checks that use it never loads
        from daemon.transport.ipc_verify import LoaderStager

        return LoaderStager(self.loader, version, device, on_verified=self._staged.add,
                            workers=workers.map if workers is not None else None)  # fmt: skip

    def retain(self, versions: set[str]) -> None:
        for version in sorted(self._staged - versions):
            try:
                self.loader.drop(version)
                self._staged.discard(version)
            except LoaderError as exc:
                log.warning("loader_drop_failed", version=version, error=str(exc))

    def close(self) -> None:
        return None


# What daemon.transport.TRANSPORTS["ipc"] names; mypy checks it against the protocol.
_DAEMON_SIDE: DaemonTransportFactory = IpcSender
