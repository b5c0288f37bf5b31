"""The registry: SQL record of every checkpoint version, check, worker, rollout and event."""

from daemon.registry.db import Registry, RegistryError
from daemon.registry.gate_runs import GateRun  # on Base.metadata with the others (migrations compare them)
from daemon.registry.models import (
    Alias,
    Check,
    Checkpoint,
    CheckpointFile,
    Event,
    Rollout,
    Worker,
    utcnow,
)
from daemon.registry.webhook_rows import (
    WebhookDelivery,  # its table in the same metadata (migrations compare)
)

__all__ = [
    "Alias",
    "Check",
    "Checkpoint",
    "CheckpointFile",
    "Event",
    "GateRun",
    "Registry",
    "RegistryError",
    "Rollout",
    "WebhookDelivery",
    "Worker",
    "utcnow",
]
