"""The registry's side of LoRA adapters: their names, per-adapter aliases, what each worker serves.

An adapter checkpoint is a `checkpoints` row of kind "adapter" with `adapter_name` (what clients
send as `model`) and `base_model`; its status moves as a full checkpoint's does (verified ->
deployed -> retired, through daemon.registry.status). Per host, each adapter name has its own
serving / last_good / pinned (`adapter_aliases`), and `worker_adapters` says which version each
worker serves under each name (the view `worker_adapter_versions` joins them for SQL readers).
Each load or unload on a worker is also an `events` row (`to_state` adapter_loaded /
adapter_unloaded / adapter_refused, the adapter and version in `detail`), written before the
next step starts, like every worker transition.

    aj = AdapterJournal(registry)
    aj.set_identity(checkpoint_id, "adapter", "sql", "org/base")   # at verify (the coordinator)
    aj.alias("sql", "serving") -> CheckpointRef | None
    aj.served_by_workers() -> {worker: {adapter: version}}
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select

from daemon.registry import hosts
from daemon.registry.db import Registry
from daemon.registry.journal import CheckpointRef, _ref, apply_moves
from daemon.registry.models import AdapterAlias, Check, Checkpoint, Event, WorkerAdapter, utcnow
from daemon.registry.queries import adapter_aliases, record_event
from daemon.registry.status import WAITING, CheckpointStatus

C = CheckpointStatus
ADAPTER = "adapter"
BASE_VERIFIED = "adapter_base_verified"  # events.to_state: an adapter version passed compat + forward on a base


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """An adapter checkpoint: the checkpoint, the name it serves under and its base."""

    checkpoint: CheckpointRef
    name: str
    base_model: str | None

    @property
    def version(self) -> str:
        return self.checkpoint.version


class AdapterJournal:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    # -- checkpoints -----------------------------------------------------------------------
    def set_identity(self, checkpoint_id: int, kind: str, name: str | None, base_model: str | None) -> None:
        with self.registry.session() as s:
            c = s.get(Checkpoint, checkpoint_id)
            if c is not None:
                c.kind, c.adapter_name, c.base_model = kind, name, base_model

    def adapter_of(self, checkpoint_id: int) -> AdapterVersion | None:
        """The adapter a checkpoint is (None: a full checkpoint, or an adapter without a name)."""
        with self.registry.session() as s:
            c = s.get(Checkpoint, checkpoint_id)
            if c is None or c.kind != ADAPTER or not c.adapter_name:
                return None
            return AdapterVersion(_ref(s, c), c.adapter_name, c.base_model)

    def is_adapter(self, checkpoint_id: int) -> bool:
        with self.registry.session() as s:
            return s.scalar(select(Checkpoint.kind).where(Checkpoint.id == checkpoint_id)) == ADAPTER

    def by_version(self, version: str) -> AdapterVersion | None:
        with self.registry.session() as s:
            c = s.scalars(select(Checkpoint).where(Checkpoint.version == version)).one_or_none()
            if c is None or c.kind != ADAPTER or not c.adapter_name:
                return None
            return AdapterVersion(_ref(s, c), c.adapter_name, c.base_model)

    def newest_waiting(self, name: str) -> AdapterVersion | None:
        """The newest verified, never deployed version of `name` (by step, then arrival)."""
        with self.registry.session() as s:
            c = s.scalars(
                select(Checkpoint)
                .where(Checkpoint.kind == ADAPTER, Checkpoint.adapter_name == name, Checkpoint.status.in_(WAITING))
                .order_by(func.coalesce(Checkpoint.step, -1).desc(), Checkpoint.id.desc())
                .limit(1)
            ).one_or_none()
            return AdapterVersion(_ref(s, c), name, c.base_model) if c else None

    def waiting_names(self) -> list[str]:
        """Adapter names with a verified version never deployed (e.g. the daemon stopped first)."""
        with self.registry.session() as s:
            return sorted(set(s.scalars(select(Checkpoint.adapter_name).where(
                Checkpoint.kind == ADAPTER, Checkpoint.adapter_name.is_not(None), Checkpoint.status.in_(WAITING)))))  # fmt: skip

    def previous_deployed(self, name: str, exclude_id: int) -> AdapterVersion | None:
        """The most recently deployed other version of `name` not rejected since."""
        with self.registry.session() as s:
            c = s.scalars(
                select(Checkpoint)
                .where(Checkpoint.kind == ADAPTER, Checkpoint.adapter_name == name, Checkpoint.id != exclude_id,
                       Checkpoint.deployed_at.is_not(None), Checkpoint.status.in_((C.DEPLOYED, C.RETIRED)))
                .order_by(func.coalesce(Checkpoint.last_deployed_at, Checkpoint.deployed_at).desc(), Checkpoint.id.desc())
                .limit(1)
            ).one_or_none()  # fmt: skip
            return AdapterVersion(_ref(s, c), name, c.base_model) if c else None

    # -- the bases a version was verified on -------------------------------------------------
    def verified_bases(self, checkpoint_id: int) -> set[str]:
        """The base versions (and digests) `checkpoint_id` passed compat + forward on: its verify
        (the compat check's `serving_base`) and every re-verify since (`adapter_base_verified`)."""
        out: set[str] = set()
        with self.registry.session() as s:
            for detail in s.scalars(select(Check.detail).where(Check.checkpoint_id == checkpoint_id, Check.name == "compat",
                                                               Check.ok.is_(True))):  # fmt: skip
                if isinstance((detail or {}).get("serving_base"), str):
                    out.add(detail["serving_base"])
            for detail in s.scalars(select(Event.detail).where(Event.checkpoint_id == checkpoint_id,
                                                               Event.to_state == BASE_VERIFIED)):  # fmt: skip
                out.update(str(detail[k]) for k in ("base", "base_digest") if (detail or {}).get(k))
        return out

    def record_base_verified(self, checkpoint_id: int, base: str, base_digest: str | None, detail: dict[str, Any]) -> None:
        with self.registry.session() as s:
            record_event(s, checkpoint_id=checkpoint_id, to_state=BASE_VERIFIED,
                         detail={"base": base, "base_digest": base_digest, **detail})  # fmt: skip

    def versions_of(self, name: str) -> list[AdapterVersion]:
        """Every version of `name` that served here (deployed or retired), newest first."""
        with self.registry.session() as s:
            rows = s.scalars(
                select(Checkpoint)
                .where(Checkpoint.kind == ADAPTER, Checkpoint.adapter_name == name, Checkpoint.deployed_at.is_not(None),
                       Checkpoint.status.in_((C.DEPLOYED, C.RETIRED)))
                .order_by(func.coalesce(Checkpoint.step, -1).desc(), Checkpoint.id.desc())
            ).all()  # fmt: skip
            return [AdapterVersion(_ref(s, c), name, c.base_model) for c in rows]

    # -- aliases ---------------------------------------------------------------------------
    def alias(self, name: str, alias: str) -> AdapterVersion | None:
        with self.registry.session() as s:
            row = s.get(AdapterAlias, (hosts.host_of(s), name, alias))
            if row is None:
                return None
            c = s.get(Checkpoint, row.checkpoint_id)
            return AdapterVersion(_ref(s, c), name, c.base_model) if c else None

    def set_alias(self, name: str, alias: str, checkpoint_id: int | None) -> None:
        with self.registry.session() as s:
            _set_alias(s, name, alias, checkpoint_id)

    def serve(self, name: str, checkpoint_id: int, moves: list[tuple[int, CheckpointStatus, str | None]]) -> None:
        """The name's `serving` alias and the status moves that go with it in one transaction (as
        `Journal.serve` for the base model)."""
        with self.registry.session() as s:
            _set_alias(s, name, "serving", checkpoint_id)
            apply_moves(s, moves)

    def names(self) -> list[str]:
        """Every adapter name with an alias on this host."""
        with self.registry.session() as s:
            return sorted(set(s.scalars(select(AdapterAlias.adapter).where(AdapterAlias.host == hosts.host_of(s)))))

    def aliases(self) -> dict[str, dict[str, str]]:
        """adapter -> {serving|last_good|pinned: version} on this host."""
        with self.registry.session() as s:
            return adapter_aliases(s)

    # -- workers ---------------------------------------------------------------------------
    def worker_loaded(self, worker: str, name: str, ckpt: CheckpointRef | None, rollout_id: int | None,
                      detail: dict[str, Any] | None = None, duration_ms: float | None = None) -> None:  # fmt: skip
        """Record that `worker` serves `ckpt` under `name` (None: nothing), with its event
        (`duration_ms`: the load and its check, what `version_history.worker_update_ms` shows)."""
        with self.registry.session() as s:
            host = hosts.host_of(s)
            row = s.get(WorkerAdapter, (host, worker, name))
            was = s.get(Checkpoint, row.checkpoint_id).version if row is not None else None  # type: ignore[union-attr]
            if ckpt is None:
                if row is not None:
                    s.delete(row)
            elif row is None:
                s.add(WorkerAdapter(host=host, worker=worker, adapter=name, checkpoint_id=ckpt.id, loaded_at=utcnow()))
            else:
                row.checkpoint_id, row.loaded_at = ckpt.id, utcnow()
            record_event(s, rollout_id=rollout_id, worker=worker, checkpoint_id=ckpt.id if ckpt else None,
                         to_state="adapter_loaded" if ckpt else "adapter_unloaded", duration_ms=duration_ms,
                         detail={"adapter": name, "version": ckpt.version if ckpt else None, "was": was, **(detail or {})})  # fmt: skip

    def worker_event(self, worker: str, to_state: str, rollout_id: int | None, ckpt: CheckpointRef | None,
                     detail: dict[str, Any]) -> None:  # fmt: skip
        """A worker's adapter step that changed nothing (e.g. `adapter_refused`)."""
        with self.registry.session() as s:
            record_event(s, rollout_id=rollout_id, worker=worker, checkpoint_id=ckpt.id if ckpt else None,
                         to_state=to_state, detail=detail)  # fmt: skip

    def served_by_workers(self, workers: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
        """worker -> {adapter: version} as recorded on this host."""
        out: dict[str, dict[str, str]] = {}
        with self.registry.session() as s:
            q = (select(WorkerAdapter.worker, WorkerAdapter.adapter, Checkpoint.version)
                 .join(Checkpoint, Checkpoint.id == WorkerAdapter.checkpoint_id)
                 .where(WorkerAdapter.host == hosts.host_of(s)))  # fmt: skip
            if workers is not None:
                q = q.where(WorkerAdapter.worker.in_(list(workers)))
            for worker, adapter, version in s.execute(q).all():
                out.setdefault(worker, {})[adapter] = version
        return out

    def version_at_path(self, name: str, path: str) -> CheckpointRef | None:
        """The version of `name` whose local copy here is `path` (an engine reports only paths)."""
        want = os.path.realpath(path)
        with self.registry.session() as s:
            ids = s.scalars(select(Checkpoint.id).where(Checkpoint.kind == ADAPTER, Checkpoint.adapter_name == name)).all()
            for cid in ids:
                local = hosts.local_path(s, cid)
                if local is not None and os.path.realpath(local) == want:
                    c = s.get(Checkpoint, cid)
                    return _ref(s, c) if c else None
        return None


def _set_alias(s: Any, name: str, alias: str, checkpoint_id: int | None) -> None:
    host = hosts.host_of(s)
    if checkpoint_id is None:
        s.execute(delete(AdapterAlias).where(AdapterAlias.host == host, AdapterAlias.adapter == name,
                                             AdapterAlias.name == alias))  # fmt: skip
        return
    row = s.get(AdapterAlias, (host, name, alias))
    if row is None:
        s.add(AdapterAlias(host=host, adapter=name, name=alias, checkpoint_id=checkpoint_id, updated_at=utcnow()))
    else:
        row.checkpoint_id, row.updated_at = checkpoint_id, utcnow()
