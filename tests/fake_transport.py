"""`memory`: a toy transport with both sides in one module, registered in daemon.transport.TRANSPORTS
by the tests that use it (that one line plus this module is all a new transport needs).

Daemon side: `prepare` puts the version's tensors in a process-wide shelf and sends its key.
Worker side: `open_update` reads the tensors back from the shelf by that key; it can also be
swapped in (a `SwapCapable` lease), so the generic update path's swap mode works with it.
"""

from __future__ import annotations

from typing import Any

import torch

from daemon.transport.base import (
    BadUpdateRequest,
    Outgoing,
    Prepared,
    SenderOptions,
    SwapLease,
    TensorSpec,
    UpdateRequest,
    pair_up,
    spec_of,
)

SHELF: dict[str, dict[str, torch.Tensor]] = {}  # key -> tensors (stands in for a trainer's process group)
RELEASED: list[str] = []


class MemorySender:
    name = "memory"

    def __init__(self, options: SenderOptions) -> None:
        self.options = options

    def prepare(self, item: Outgoing) -> Prepared:
        return Prepared(UpdateRequest(item.version, "memory", {"key": item.version}, "copy", item.expect))

    def retain(self, versions: set[str]) -> None:
        return None

    def close(self) -> None:
        return None


class MemoryTransport:
    name = "memory"

    def __init__(self, key: str) -> None:
        self.key = key
        self.tensors = SHELF[key]
        self._copied = 0

    def table(self) -> dict[str, TensorSpec]:
        return {n: spec_of(n, t) for n, t in self.tensors.items()}

    def write_into(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.tensors[n])
        self._copied = len(params)

    def source_digest(self) -> str | None:
        return None  # nothing at the source states a digest

    def stats(self) -> dict[str, Any]:
        return {"memory_tensors": self._copied}

    def lease(self, params: dict[str, torch.Tensor]) -> SwapLease:
        return SwapLease(pair_up(params, self.tensors), lambda: RELEASED.append(self.key))

    def close(self) -> None:
        return None


def open_update(request: UpdateRequest, store: Any) -> MemoryTransport:
    key = request.source.get("key")
    if not isinstance(key, str) or key not in SHELF:
        raise BadUpdateRequest(f"the memory transport needs 'key' of a shelved version, got {key!r}")
    return MemoryTransport(key)
