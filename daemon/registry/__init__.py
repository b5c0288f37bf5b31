"""The registry: SQL record of every checkpoint version, check, worker, rollout and event."""

from typing import TYPE_CHECKING

from daemon import public_face
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

if TYPE_CHECKING:
    from daemon.registry import hosts, queries, retention, status
    from daemon.registry.adapters import AdapterJournal, AdapterVersion
    from daemon.registry.db import redact_url
    from daemon.registry.gate_runs import add_run, last_good_score, summary, summary_line
    from daemon.registry.journal import CheckpointRef, Journal, RolloutRef
    from daemon.registry.models import (
        GOOD_WHERE,
        WORKER_STATES,
        CheckpointLocation,
        FleetDecider,
        FleetHostReason,
        FleetLease,
        FleetRollout,
        FleetRolloutHost,
        FleetTarget,
    )
    from daemon.registry.outbox import unreachable
    from daemon.registry.queries import record_event
    from daemon.registry.status import (
        DEPLOYABLE,
        TRANSITIONS,
        UNFINISHED,
        WAITING,
        CheckpointStatus,
        FailureKind,
        RolloutOutcome,
        RolloutTrigger,
    )
    from daemon.registry.webhook_rows import DELIVERY_STATES

__all__ = [
    "AdapterJournal", "AdapterVersion", "Alias", "Check", "Checkpoint", "CheckpointFile",
    "CheckpointLocation", "CheckpointRef", "CheckpointStatus", "DELIVERY_STATES", "DEPLOYABLE", "Event",
    "FailureKind", "FleetDecider", "FleetHostReason", "FleetLease", "FleetRollout", "FleetRolloutHost",
    "FleetTarget", "GOOD_WHERE", "GateRun", "Journal", "Registry", "RegistryError", "Rollout",
    "RolloutOutcome", "RolloutRef", "RolloutTrigger", "TRANSITIONS", "UNFINISHED", "WAITING",
    "WORKER_STATES", "WebhookDelivery", "Worker", "add_run", "hosts", "last_good_score", "queries",
    "record_event", "redact_url", "retention", "status", "summary", "summary_line", "unreachable",
    "utcnow"
]

__getattr__ = public_face(__name__)
