"""The registry: SQL record of every checkpoint version, check, worker, rollout and event."""

from daemon.registry.db import Registry, RegistryError
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

__all__ = [
    "Alias",
    "Check",
    "Checkpoint",
    "CheckpointFile",
    "Event",
    "Registry",
    "RegistryError",
    "Rollout",
    "Worker",
    "utcnow",
]
