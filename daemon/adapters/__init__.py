"""Daemon-side clients for workers, chosen by `[[workers]] kind`: one table of kinds.

    WORKER_KINDS   kind -> "module:connect", a `daemon.adapters.base.ClientFactory`
    make_client(kind, name, url, token_file=..., timeouts=...) -> WorkerClient

The rollout engine only ever sees the `WorkerClient` protocol and its `Capabilities`.

How to add a worker kind (e.g. `vllm`): write `daemon/adapters/vllm.py` with a class that
implements `WorkerClient` (declare its `capabilities`: pause modes, drain, transports,
restores_itself, atomic_updates, reports_in_flight) and a `connect(name, url, *, token_file,
timeouts)` function, then add one line here: `"vllm": "daemon.adapters.vllm:connect"`. The
config (`[[workers]] kind`), the `workers` table's validation and the rollout pick it up by name.
"""

from __future__ import annotations

import importlib
from typing import cast

from daemon.adapters.base import ClientFactory, Timeouts, WorkerClient

WORKER_KINDS: dict[str, str] = {
    "builtin": "daemon.adapters.builtin:connect",
}
MANAGED_KIND = "builtin"  # the kind the daemon can run itself (`launch = "managed"`: `hotswap worker`)


def make_client(kind: str, name: str, url: str, *, token_file: str | None, timeouts: Timeouts) -> WorkerClient:
    module, attr = WORKER_KINDS[kind].split(":")
    factory = cast(ClientFactory, getattr(importlib.import_module(module), attr))
    return factory(name, url, token_file=token_file, timeouts=timeouts)


__all__ = ["MANAGED_KIND", "WORKER_KINDS", "make_client"]
