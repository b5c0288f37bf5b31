"""How each webhook's deliveries stand, from the outbox: for /status, `hotswap status` and /metrics
(`hotswap_webhook_deliveries{webhook, state}`, read at scrape time so it survives restarts)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from daemon.registry import DELIVERY_STATES, Registry, WebhookDelivery
from daemon.webhooks.settings import WebhookSettings


def webhook_report(registry: Registry, hooks: list[WebhookSettings]) -> list[dict[str, Any]]:
    """Per webhook: deliveries by state, those retrying, the last error of a pending or given-up one."""
    d = WebhookDelivery
    with registry.session() as s:
        counts = s.execute(select(d.webhook, d.state, func.count()).where(d.host == registry.host)
                           .group_by(d.webhook, d.state)).all()  # fmt: skip
        retrying = dict(s.execute(select(d.webhook, func.count()).where(
            d.host == registry.host, d.state == "pending", d.attempts > 0).group_by(d.webhook)).all())  # fmt: skip
        errors = {w: e for w, e in s.execute(select(d.webhook, d.last_error).where(
            d.host == registry.host, d.state != "delivered", d.last_error.is_not(None)).order_by(d.id))}  # fmt: skip
    out = []
    for h in hooks:
        by_state = {st: 0 for st in DELIVERY_STATES}
        by_state.update({st: int(n) for w, st, n in counts if w == h.name})
        out.append({"name": h.name, **by_state, "retrying": int(retrying.get(h.name, 0)),
                    "last_error": errors.get(h.name)})  # fmt: skip
    return out


class WebhookCollector(Collector):
    def __init__(self, registry: Registry, hooks: list[WebhookSettings]) -> None:
        self.registry, self.hooks = registry, hooks

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("hotswap_webhook_deliveries", "Webhook deliveries of this host by webhook and state "
                              "(pending, delivered, undeliverable: given up after max_attempts)",
                              labels=["webhook", "state"])  # fmt: skip
        try:
            rows = webhook_report(self.registry, self.hooks)
        except Exception:  # noqa: BLE001 - the database away: no sample (its problem says so)
            rows = []
        for r in rows:
            for st in DELIVERY_STATES:
                g.add_metric([r["name"], st], r[st])
        yield g
