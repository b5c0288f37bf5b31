"""The body of `POST /admin/init_weight_group`, which both ends read: where the trainer's store is
and a worker's rank. Light on purpose: the engine clients' protocol names it, and the vLLM worker
extension imports that protocol's package in vLLM's venv, which has no strong-hash library.
The broadcast session itself is `daemon.transport.broadcast`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

from daemon.transport.base import BadUpdateRequest

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """`POST /admin/init_weight_group`'s body: where the trainer's store is and this worker's rank."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    group_name: str
    timeout_s: float

    def to_json(self) -> dict[str, Any]:
        return {"master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": self.rank_offset, "world_size": self.world_size, "backend": self.backend,
                "group_name": self.group_name, "timeout_s": self.timeout_s}  # fmt: skip

    @classmethod
    def from_json(cls, doc: Any) -> GroupSpec:
        if not isinstance(doc, dict):
            raise BadUpdateRequest("init_weight_group body must be a JSON object")
        addr, port, off, size = doc.get("master_address"), doc.get("master_port"), doc.get("rank_offset"), doc.get("world_size")
        backend, name, timeout = doc.get("backend", "gloo"), doc.get("group_name"), doc.get("timeout_s", 60.0)
        if not isinstance(addr, str) or not addr:
            raise BadUpdateRequest("'master_address' must be a host name or address")
        if not _int(port) or not 1 <= port <= 65535:
            raise BadUpdateRequest("'master_port' must be an integer in [1, 65535]")
        if not _int(size) or size < 2:
            raise BadUpdateRequest("'world_size' must be an integer >= 2 (the trainer and a worker)")
        if not _int(off) or not 1 <= off < size:
            raise BadUpdateRequest("'rank_offset' must be an integer in [1, world_size) (rank 0 is the trainer)")
        if backend not in BACKENDS:
            raise BadUpdateRequest(f"'backend' must be one of {list(BACKENDS)}, not {backend!r}")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise BadUpdateRequest("'group_name' must be a non-empty string (at most 128 characters)")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout <= 3600:
            raise BadUpdateRequest("'timeout_s' must be a number in (0, 3600]")
        return cls(addr, port, off, size, backend, name, float(timeout))


def _int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)
