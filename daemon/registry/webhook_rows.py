"""`webhook_deliveries`: the webhook outbox (daemon.webhooks). One row per event and webhook,
written in the transaction that records the event, so a delivery exists exactly when its event
does; the sender updates it until it is delivered or given up (`undeliverable`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from daemon.registry.models import Base, utcnow

DELIVERY_STATES = ("pending", "delivered", "undeliverable")


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_due", "host", "webhook", "state", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # the order deliveries are sent in
    delivery_id: Mapped[str] = mapped_column(String(36), unique=True)  # stable across retries and restarts
    host: Mapped[str] = mapped_column(String(255))  # the daemon that recorded the event, and sends it
    webhook: Mapped[str] = mapped_column(String(255))  # [[webhooks]] name
    event: Mapped[str] = mapped_column(String(64))  # "version.deployed", ... (daemon.webhooks.events)
    event_id: Mapped[int] = mapped_column(BigInteger)  # events.id (no foreign key: retention prunes events)
    version: Mapped[str | None] = mapped_column(String(255))
    payload: Mapped[dict[str, Any]] = mapped_column()
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column()
    last_status: Mapped[int | None] = mapped_column(Integer)  # the receiver's last HTTP status
    last_error: Mapped[str | None] = mapped_column(Text)
