"""Daemon-side clients for workers, chosen by `[[workers]] kind`: one table of kinds.

    WORKER_KINDS   kind -> "module:connect", a `daemon.engines.base.ClientFactory`
    make_client(kind, name, url, token_file=..., timeouts=...) -> WorkerClient

The rollout engine only ever sees the `WorkerClient` protocol and its `Capabilities`.

How to add a worker kind (e.g. `vllm`): write `daemon/engines/vllm.py` with a class that
implements `WorkerClient` (declare its `capabilities`: pause modes, drain, transports,
restores_itself, atomic_updates, reports_in_flight) and a `connect(name, url, *, token_file,
timeouts)` function, then add one line here: `"vllm": "daemon.engines.vllm:connect"`. The
config (`[[workers]] kind`), the `workers` table's validation and the rollout pick it up by name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from daemon import public_face
from daemon.engines.base import ClientFactory, Timeouts, WorkerClient

if TYPE_CHECKING:
    from daemon.engines.base import (
        AdapterRequest,
        Capabilities,
        MapsAhead,
        NonFiniteOutput,
        PreparesUpdates,
        ReadsAhead,
        ResumesAfterUpdate,
        ServesAdapters,
        UpdateRefused,
        UpdateResult,
        WeightInfo,
        WorkerError,
        WorkerUnreachable,
    )

WORKER_KINDS: dict[str, str] = {
    "builtin": "daemon.engines.builtin:connect",
    "vllm": "daemon.engines.vllm:connect",
    "sglang": "daemon.engines.sglang:connect",
}
# Engine kinds: the `[[workers]]` keys they take beyond url/token_file/restart_command, and their
# pause modes (tests/config/test_engine_kinds.py checks these against the clients' own tables).
ENGINE_PAUSE_MODES: dict[str, tuple[str, ...]] = {"vllm": ("keep", "wait", "abort"), "sglang": ("retract", "abort")}
ENGINE_KEYS: dict[str, tuple[str, ...]] = {"vllm": ("pause_mode",), "sglang": ("pause_mode", "admin_token_file")}
MANAGED_KIND = "builtin"  # the kind the daemon can run itself (`launch = "managed"`: `hotswap worker`)


def make_client(
    kind: str, name: str, url: str, *, token_file: str | None, timeouts: Timeouts, options: dict[str, Any] | None = None
) -> WorkerClient:
    """`options`: the engine keys of ENGINE_KEYS[kind] that the entry sets (only engine kinds take any)."""
    module, attr = WORKER_KINDS[kind].split(":")
    factory = getattr(importlib.import_module(module), attr)
    if options:
        return cast(WorkerClient, factory(name, url, token_file=token_file, timeouts=timeouts, options=options))
    return cast(ClientFactory, factory)(name, url, token_file=token_file, timeouts=timeouts)


__all__ = [
    "AdapterRequest", "Capabilities", "ENGINE_KEYS", "ENGINE_PAUSE_MODES", "MANAGED_KIND",
    "MapsAhead", "NonFiniteOutput", "PreparesUpdates", "ReadsAhead", "ResumesAfterUpdate", "ServesAdapters", "Timeouts",
    "UpdateRefused", "UpdateResult", "WORKER_KINDS", "WeightInfo", "WorkerClient", "WorkerError",
    "WorkerUnreachable", "make_client"
]

__getattr__ = public_face(__name__)
