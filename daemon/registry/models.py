"""SQLAlchemy 2 models of the registry: every version and every transition is a row.

The closed vocabularies are enums here (checkpoint status, rollout trigger and outcome, failure
kind); the columns store their plain string values, validated on assignment (not database enums),
so that adding a status never needs a table rewrite in a migration. Checkpoint status changes
only through `daemon.registry.status`. All timestamps are UTC and
timezone-aware in Python on both SQLite and PostgreSQL (see `UTCDateTime`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    PrimaryKeyConstraint,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, validates
from sqlalchemy.types import TypeDecorator


class CheckpointStatus(StrEnum):
    DISCOVERED = "discovered"  # registered; nothing read past a listing
    FETCHING = "fetching"  # its source is turning it into a local directory (download, receive)
    VERIFYING = "verifying"
    VERIFIED = "verified"
    REJECTED = "rejected"
    DEFERRED = "deferred"  # not enough headroom now; retried
    STAGED = "staged"  # the transport holds a copy ready for workers (the loader)
    DEPLOYED = "deployed"
    RETIRED = "retired"  # was deployed, replaced
    SUPERSEDED = "superseded"  # a newer version arrived before it was deployed
    DUPLICATE = "duplicate"  # same content as an earlier version


class RolloutTrigger(StrEnum):
    NEW = "new"  # a newly verified checkpoint
    FLEET = "fleet"  # this host converging to the fleet's target version (daemon.fleet.agent)
    ROLLBACK = "rollback"  # back to an earlier version (operator, health window, reconcile)
    MANUAL = "manual"  # an operator's pin


class RolloutOutcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"  # succeeded, then the health window rolled it back
    SUPERSEDED = "superseded"  # stopped at a batch boundary for newer work


class FailureKind(StrEnum):
    """Why a worker failed a step (`rollouts.detail.kind`)."""

    REFUSED = "refused"  # the worker answered and refused; its weights are unchanged
    UNREACHABLE = "unreachable"  # no answer at all
    MISMATCH = "mismatch"  # it answered with another version or digest than asked for
    ERROR = "error"  # anything else
    UNAVAILABLE = "unavailable"  # a worker was down before the rollout and could not be brought back


# the rollout state machine's states (daemon.rollout.states) plus what the health poll observes
WORKER_STATES = ("UNKNOWN", "RUNNING", "DRAINING", "PAUSED", "UPDATED", "UNHEALTHY", "UNCERTAIN", "UNREACHABLE")
CHECKPOINT_STATUSES = tuple(s.value for s in CheckpointStatus)
ROLLOUT_TRIGGERS = tuple(t.value for t in RolloutTrigger)
ROLLOUT_OUTCOMES = tuple(o.value for o in RolloutOutcome)
ALIAS_NAMES = ("serving", "last_good", "pinned")
CHECKPOINT_KINDS = ("full", "adapter")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python.

    SQLite has no time zone type: values are stored as naive UTC text and get
    their tzinfo back on the way out. PostgreSQL stores `timestamptz`.
    Naive datetimes are refused so local times cannot sneak in.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: registry timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _check_choice(
    field: str, value: str | None, choices: tuple[str, ...], nullable: bool = False
) -> str | None:
    if value is None and nullable:
        return None
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(choices)}")
    return value


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


# A version the fleet may follow without an operator (daemon.fleet.target.good), when it got there
# through `last_good_at`: the partial index `ix_checkpoints_good` holds exactly these (migration 0011).
GOOD_WHERE = ("last_good_at IS NOT NULL AND verified_at IS NOT NULL "
              "AND status IN ('verified', 'staged', 'deployed', 'retired', 'superseded')")  # fmt: skip


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    # the good versions by step then arrival: the fleet target and each host's lag (fleet_versions)
    # and the versions that served, most recently deployed first (fallbacks, rollbacks)
    __table_args__ = (Index("ix_checkpoints_good", "step", "id", sqlite_where=text(GOOD_WHERE),
                            postgresql_where=text(GOOD_WHERE)),
                      Index("ix_checkpoints_last_deployed", "last_deployed_at", "id"))  # fmt: skip

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[str] = mapped_column(String(255), unique=True)
    source: Mapped[str] = mapped_column(String(255))  # source name from the config, e.g. "local:/data/ckpt"
    uri: Mapped[str] = mapped_column(Text)  # where it was found (file:// path, s3:// prefix, push URL)
    local_path: Mapped[str | None] = mapped_column(Text)
    commit_signal: Mapped[str | None] = mapped_column(String(32))  # manifest | index | marker | push
    step: Mapped[int | None] = mapped_column(BigInteger)
    parent: Mapped[str | None] = mapped_column(String(255))
    digest: Mapped[str | None] = mapped_column(String(80), index=True)  # "<alg>:<hex>" (daemon.hashing)
    total_bytes: Mapped[int | None] = mapped_column(BigInteger)
    tensor_count: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(32), index=True, default="discovered")
    status_message: Mapped[str | None] = mapped_column(Text)
    discovered_at: Mapped[datetime] = mapped_column(default=utcnow)
    verified_at: Mapped[datetime | None]
    deployed_at: Mapped[datetime | None]  # the first deploy; never overwritten (a rollback keeps it)
    last_deployed_at: Mapped[datetime | None]  # every time it became the deployed version
    last_good_at: Mapped[datetime | None]  # the last time some host made it its last_good (the fleet target)
    # "full" (a whole model) or "adapter" (a LoRA adapter, PEFT layout: daemon.formats.adapter)
    kind: Mapped[str] = mapped_column(String(16), default="full", server_default="full")
    adapter_name: Mapped[str | None] = mapped_column(String(255), index=True)  # what clients send as `model`
    base_model: Mapped[str | None] = mapped_column(Text)  # the base an adapter was trained for
    # how it arrived (daemon.delta): "full" or "delta" (None: before migration 0017, or not fetched yet),
    # the base a delta was rebuilt from, bytes read from the source, delta bytes / full result bytes
    encoding: Mapped[str | None] = mapped_column(String(16))
    delta_base: Mapped[str | None] = mapped_column(String(255))
    fetched_bytes: Mapped[int | None] = mapped_column(BigInteger)
    delta_ratio: Mapped[float | None] = mapped_column(Float)
    tensors_changed: Mapped[int | None] = mapped_column(Integer)  # (0022) a delta's, from its base
    elements_changed: Mapped[int | None] = mapped_column(BigInteger)
    compacted_from: Mapped[str | None] = mapped_column(String(255))  # its compacted delta's anchor, and bytes
    compacted_bytes: Mapped[int | None] = mapped_column(BigInteger)

    files: Mapped[list[CheckpointFile]] = relationship(back_populates="checkpoint", cascade="all, delete-orphan",
                                                       order_by="CheckpointFile.path")  # fmt: skip
    checks: Mapped[list[Check]] = relationship(
        back_populates="checkpoint", cascade="all, delete-orphan", order_by="Check.id"
    )

    @validates("status")
    def _validate_status(self, _key: str, value: str) -> str:
        return _check_choice("checkpoints.status", value, CHECKPOINT_STATUSES)  # type: ignore[return-value]

    @validates("kind")
    def _validate_kind(self, _key: str, value: str) -> str:
        return _check_choice("checkpoints.kind", value, CHECKPOINT_KINDS)  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"Checkpoint(version={self.version!r}, status={self.status!r})"


class CheckpointStatusCount(Base):
    """How many checkpoints are in each status, kept by triggers on `checkpoints` (migration 0012):
    the counts `hotswap status`, `/status` and /metrics show, without counting the history."""

    __tablename__ = "checkpoint_status_counts"

    status: Mapped[str] = mapped_column(String(32), primary_key=True)
    n: Mapped[int] = mapped_column(BigInteger)


class CheckpointFile(Base):
    __tablename__ = "checkpoint_files"
    __table_args__ = (UniqueConstraint("checkpoint_id", "path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True)
    path: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    crc32c: Mapped[str | None] = mapped_column(String(8))
    # the strong hash the verify stage computed from the bytes: what transports compare with
    hash_alg: Mapped[str | None] = mapped_column(String(16))  # "blake3" | "sha256"
    hash: Mapped[str | None] = mapped_column(String(128))  # hex

    checkpoint: Mapped[Checkpoint] = relationship(back_populates="files")


class Check(Base):
    __tablename__ = "checks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    ok: Mapped[bool] = mapped_column(Boolean)
    deferred: Mapped[bool] = mapped_column(Boolean, default=False)
    status: Mapped[str | None] = mapped_column(String(16))  # pass | fail | deferred | skipped
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    duration_ms: Mapped[float] = mapped_column(Float)

    checkpoint: Mapped[Checkpoint] = relationship(back_populates="checks")


class Worker(Base):
    __tablename__ = "workers"
    __table_args__ = (UniqueConstraint("host", "name", name="uq_workers_host_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255), index=True)  # the daemon's host (daemon.fleet.settings)
    name: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(32), default="builtin")  # validated by the config (daemon.engines)
    url: Mapped[str] = mapped_column(Text)
    device: Mapped[str | None] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(32), default="UNKNOWN")
    weight_version: Mapped[str | None] = mapped_column(String(255))
    last_error: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    @validates("state")
    def _validate_state(self, _key: str, value: str) -> str:
        return _check_choice("workers.state", value, WORKER_STATES)  # type: ignore[return-value]


class Rollout(Base):
    __tablename__ = "rollouts"
    # the rollouts in flight (recovery at start, retention): a handful of entries whatever the history
    __table_args__ = (Index("ix_rollouts_in_flight", "id", sqlite_where=text("outcome IS NULL"),
                            postgresql_where=text("outcome IS NULL")),)  # fmt: skip

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    host: Mapped[str | None] = mapped_column(String(255), index=True)  # the host whose workers it moved
    trigger: Mapped[str] = mapped_column(String(32), default="new")
    transport: Mapped[str] = mapped_column(String(32), default="disk")
    mode: Mapped[str] = mapped_column(String(32), default="copy")
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    outcome: Mapped[str | None] = mapped_column(String(32))  # NULL while in flight
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    checkpoint: Mapped[Checkpoint] = relationship()

    @validates("trigger")
    def _validate_trigger(self, _key: str, value: str) -> str:
        return _check_choice("rollouts.trigger", value, ROLLOUT_TRIGGERS)  # type: ignore[return-value]

    @validates("outcome")
    def _validate_outcome(self, _key: str, value: str | None) -> str | None:
        return _check_choice("rollouts.outcome", value, ROLLOUT_OUTCOMES, nullable=True)


class Event(Base):
    """Append-only log of transitions: worker states during rollouts, and checkpoint statuses.

    A worker transition has `worker` set (and usually `rollout_id`); a checkpoint
    status change has `checkpoint_id` set and `worker` NULL.
    """

    __tablename__ = "events"
    # the newest event of a kind (the last rejection for /metrics) without reading every row
    __table_args__ = (Index("ix_events_to_state_at", "to_state", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    host: Mapped[str | None] = mapped_column(String(255), index=True)  # the daemon that wrote it
    rollout_id: Mapped[int | None] = mapped_column(ForeignKey("rollouts.id"), index=True)
    checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    worker: Mapped[str | None] = mapped_column(String(255))
    from_state: Mapped[str | None] = mapped_column(String(32))
    to_state: Mapped[str] = mapped_column(String(32))
    duration_ms: Mapped[float | None] = mapped_column(Float)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Alias(Base):
    """serving / last_good / pinned of one host: every host has its own."""

    __tablename__ = "aliases"

    host: Mapped[str] = mapped_column(String(255), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    checkpoint: Mapped[Checkpoint] = relationship()

    @validates("name")
    def _validate_name(self, _key: str, value: str) -> str:
        return _check_choice("aliases.name", value, ALIAS_NAMES)  # type: ignore[return-value]


class CheckpointLocation(Base):
    """Where a checkpoint's bytes are on one host (a checkpoint is one row fleet-wide)."""

    __tablename__ = "checkpoint_locations"
    __table_args__ = (PrimaryKeyConstraint("checkpoint_id", "host"),)

    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(255), index=True)
    local_path: Mapped[str] = mapped_column(Text)
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)


class FleetLease(Base):
    """One slot of the fleet-wide bound on hosts updating at once (`[fleet] max_updating_hosts`)."""

    __tablename__ = "fleet_leases"

    slot: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    host: Mapped[str | None] = mapped_column(String(255))  # NULL: free
    version: Mapped[str | None] = mapped_column(String(255))  # what the holder is rolling out
    acquired_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]  # renewed while updating; past it the slot is free again


class FleetTarget(Base):
    """An operator's explicit fleet version (one row, id 1); without it the target is the newest
    verified, not rejected version that was some host's `last_good` (daemon.fleet.target)."""

    __tablename__ = "fleet_target"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    set_at: Mapped[datetime] = mapped_column(default=utcnow)
    set_by: Mapped[str | None] = mapped_column(String(255))
    signature: Mapped[str | None] = mapped_column(Text)  # Ed25519 by [fleet] signing_key (daemon.fleet.trust)


class FleetHostReason(Base):
    """Why one host does not serve the fleet target, as its own fleet agent last saw it
    (daemon.fleet.behind); no row while it serves the target."""

    __tablename__ = "fleet_host_reasons"

    host: Mapped[str] = mapped_column(String(255), primary_key=True)
    target: Mapped[str] = mapped_column(String(255))  # the fleet target it is not on
    cause: Mapped[str] = mapped_column(String(32))  # one word: not_here, pinned, waiting, failed, ...
    reason: Mapped[str] = mapped_column(Text)  # one line, naming the target and the cause
    since: Mapped[datetime] = mapped_column(default=utcnow)  # behind this target since
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)  # the reason last changed


class AdapterAlias(Base):
    """serving / last_good / pinned of one LoRA adapter name on one host (a full checkpoint's are `aliases`)."""

    __tablename__ = "adapter_aliases"
    __table_args__ = (PrimaryKeyConstraint("host", "adapter", "name"),)

    host: Mapped[str] = mapped_column(String(255))
    adapter: Mapped[str] = mapped_column(String(255))
    name: Mapped[str] = mapped_column(String(64))
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    @validates("name")
    def _validate_name(self, _key: str, value: str) -> str:
        return _check_choice("adapter_aliases.name", value, ALIAS_NAMES)  # type: ignore[return-value]


class WorkerAdapter(Base):
    """Which version of a LoRA adapter one worker serves, as the daemon last loaded or saw it."""

    __tablename__ = "worker_adapters"
    __table_args__ = (PrimaryKeyConstraint("host", "worker", "adapter"),)

    host: Mapped[str] = mapped_column(String(255))
    worker: Mapped[str] = mapped_column(String(255))
    adapter: Mapped[str] = mapped_column(String(255))
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    loaded_at: Mapped[datetime] = mapped_column(default=utcnow)


class FleetRollout(Base):
    """A staged fleet rollout of one version (daemon.fleet.stages): its plan, the stage it is in
    and its state; decided in the registry by whichever host holds the stage lock."""

    __tablename__ = "fleet_rollouts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), unique=True)
    previous_checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id", ondelete="SET NULL"))
    plan: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # the stages, as configured when it began
    stage: Mapped[int] = mapped_column(Integer, default=0)  # the stage whose hosts may take the version
    state: Mapped[str] = mapped_column(String(16), index=True)  # running, paused, halted, aborted, done, superseded
    reason: Mapped[str | None] = mapped_column(Text)  # why it halted, paused or was aborted
    created_by: Mapped[str | None] = mapped_column(String(255))  # the host that began it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    stage_started_at: Mapped[datetime] = mapped_column(default=utcnow)
    stage_ready_at: Mapped[datetime | None]  # every host of the stage passed: its bake time runs from here
    stalled: Mapped[str | None] = mapped_column(Text)  # a decision due and the lock held elsewhere (fleet_stalled)


class FleetRolloutHost(Base):
    """One host's place in a staged rollout: the stage that admitted it."""

    __tablename__ = "fleet_rollout_hosts"
    __table_args__ = (PrimaryKeyConstraint("rollout_id", "host"),)

    rollout_id: Mapped[int] = mapped_column(ForeignKey("fleet_rollouts.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(255))
    stage: Mapped[int] = mapped_column(Integer)
    admitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    decided_by: Mapped[str | None] = mapped_column(String(255))  # the deciding host (daemon.fleet.trust)
    tick: Mapped[int | None] = mapped_column(BigInteger)  # its decision number (fleet_decider.tick)
    signature: Mapped[str | None] = mapped_column(Text)  # Ed25519 by [fleet] signing_key


class FleetDecider(Base):
    """One row (id 1): the staged-rollout decision lock (a row lock: only a role that may UPDATE
    this table can hold it) and the last decision taken under it."""

    __tablename__ = "fleet_decider"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    tick: Mapped[int] = mapped_column(BigInteger, default=0)  # decisions taken so far, fleet-wide
    host: Mapped[str | None] = mapped_column(String(255))  # the host that took the last one
    decided_at: Mapped[datetime | None]
