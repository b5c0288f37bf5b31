"""`LoaderClient`: how the daemon, the rollout engine and workers talk to `hotswap loader`.

    client = LoaderClient("/run/hotswap/loader.sock")
    info = client.stage("step-1200", "/ckpt/step-1200", digest="8f3a21c0")   # once per version
    descriptor = client.descriptor("step-1200")   # JSON; one buffer per staged GPU
    worker.update(UpdateRequest("step-1200", "ipc", {"descriptor": descriptor}, "copy"))  # daemon.transport.base

Workers acquire and release versions themselves (the descriptor names the loader socket), so
the caller never has to. Each call opens its own connection: no state to lose on errors.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from daemon.handoff.loader_protocol import (
    MAX_RESPONSE_BYTES,
    LoaderError,
    LoaderUnavailable,
    ProtocolError,
    decode,
    encode,
    read_line,
)

__all__ = ["LoaderClient", "LoaderError", "LoaderUnavailable", "StagedInfo"]


@dataclass(frozen=True, slots=True)
class StagedInfo:
    version: str
    bytes: int
    tensors: int
    devices: list[str]
    seconds: float


class LoaderClient:
    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        timeout: float = 30.0,
        stage_timeout: float = 1800.0,
        peer_uids: frozenset[int] | None = None,
    ):
        """`peer_uids`: answers are taken only from a loader process running as one of these users
        (checked with SO_PEERCRED on every connection); None trusts whoever listens."""
        self.socket_path = os.fspath(socket_path)
        self.peer_uids = peer_uids
        self.timeout = timeout
        self.stage_timeout = stage_timeout
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return f"LoaderClient({self.socket_path!r})"

    def call(self, op: str, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one request and return its `result`; LoaderError with the loader's reason on failure."""
        rid = next(self._ids)
        request = {"op": op, "id": rid, **{k: v for k, v in args.items() if v is not None}}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout or self.timeout)
        try:
            try:
                sock.connect(self.socket_path)
                self._check_peer(sock)
                sock.sendall(encode(request))
                line = read_line(sock, bytearray(), MAX_RESPONSE_BYTES)
            except (FileNotFoundError, ConnectionError, TimeoutError, OSError) as exc:
                raise LoaderUnavailable(f"loader at {self.socket_path}: {op} failed ({exc})") from None
        finally:
            sock.close()
        if line is None:
            raise LoaderUnavailable(f"loader at {self.socket_path} closed the connection during {op}")
        doc = decode(line)
        if doc.get("id") != rid:
            raise ProtocolError(f"loader answered request {doc.get('id')!r}, expected {rid}")
        if not doc.get("ok"):
            raise LoaderError(f"loader: {op} refused: {doc.get('error', 'no reason given')}")
        result = doc.get("result")
        if not isinstance(result, dict):
            raise ProtocolError(f"loader: {op} answer has no result object")
        return result

    def _check_peer(self, sock: socket.socket) -> None:
        if self.peer_uids is None:
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid not in self.peer_uids:
            raise LoaderError(f"loader at {self.socket_path} runs as uid {uid}, not a trusted user; refused")

    def stage(
        self,
        version: str,
        path: str | os.PathLike[str],
        digest: str | None = None,
        files: list[dict[str, Any]] | None = None,
    ) -> StagedInfo:
        """`files`: the verified per-file digests ({path, bytes, digests}) the loader checks the bytes against."""
        r = self.call("stage", self.stage_timeout, version=version, path=os.fspath(path), digest=digest, files=files)
        return StagedInfo(r["version"], r["bytes"], r["tensors"], list(r["devices"]), r["seconds"])

    def stage_for_verify(self, version: str, path: str | os.PathLike[str], alg: str) -> dict[str, Any]:
        """Stage with no reference: the loader answers its own `alg` + CRC32C digests of every file
        (`digests`) and holds the version back until `verified` (the daemon's verify reads here)."""
        return self.call("stage", self.stage_timeout, version=version, path=os.fspath(path), verify_alg=alg)

    def verified(self, version: str, files: list[dict[str, Any]], digest: str | None = None) -> dict[str, Any]:
        return self.call("verified", version=version, files=files, digest=digest)

    def descriptor(self, version: str, device: str | None = None, purpose: str | None = None) -> dict[str, Any]:
        return self.call("descriptor", version=version, device=device, purpose=purpose)

    def acquire(self, version: str, worker: str, pid: int | None = None) -> dict[str, Any]:
        return self.call("acquire", version=version, worker=worker, pid=pid)

    def release(self, version: str, worker: str) -> dict[str, Any]:
        return self.call("release", version=version, worker=worker)

    def drop(self, version: str) -> dict[str, Any]:
        return self.call("drop", version=version)

    def status(self) -> dict[str, Any]:
        return self.call("status")
