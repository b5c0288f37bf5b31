"""The outbox hook: a delivery row per webhook event and interested webhook, written by the flush
that writes the event, so both commit (or roll back) together. Nothing here sends anything."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from daemon.common import redact_doc
from daemon.registry import Checkpoint, Event, Registry, WebhookDelivery, utcnow
from daemon.webhooks.events import webhook_event
from daemon.webhooks.settings import WebhookSettings

_WRITTEN = "webhook_deliveries_written"


def install(registry: Registry, hooks: list[WebhookSettings], wake: Callable[[], None] | None = None) -> None:
    """Every session of `registry` writes deliveries for `hooks`; `wake` runs after a commit that wrote some."""
    if not hooks:
        return

    def after_flush(s: Session, _ctx: Any) -> None:
        rows = [row for obj in s.new if isinstance(obj, Event) for row in _deliveries(s, obj, hooks)]
        if rows:
            s.connection().execute(insert(WebhookDelivery.__table__), rows)  # type: ignore[arg-type]
            s.info[_WRITTEN] = True

    def after_commit(s: Session) -> None:
        if s.info.pop(_WRITTEN, False) and wake is not None:
            wake()

    registry.listen("after_flush", after_flush)
    registry.listen("after_commit", after_commit)
    registry.listen("after_rollback", lambda s: s.info.pop(_WRITTEN, None))


def _deliveries(s: Session, ev: Event, hooks: list[WebhookSettings]) -> list[dict[str, Any]]:
    name = webhook_event(ev.from_state, ev.to_state)
    wanted = [h for h in hooks if name is not None and h.wants(name)]
    if name is None or not wanted:
        return []
    version = None
    if ev.checkpoint_id is not None:
        version = s.connection().execute(select(Checkpoint.version).where(Checkpoint.id == ev.checkpoint_id)).scalar()
    at, now = ev.at or utcnow(), utcnow()
    rows = []
    for hook in wanted:
        delivery_id = str(uuid.uuid4())
        payload = {"id": delivery_id, "event": name, "at": at.isoformat(), "host": ev.host, "version": version,
                   "event_id": ev.id, "from": ev.from_state, "to": ev.to_state, "detail": redact_doc(ev.detail or {})}  # fmt: skip
        rows.append({"delivery_id": delivery_id, "host": ev.host, "webhook": hook.name, "event": name,
                     "event_id": ev.id, "version": version, "payload": payload, "state": "pending", "attempts": 0,
                     "created_at": now, "next_attempt_at": now})  # fmt: skip
    return rows
