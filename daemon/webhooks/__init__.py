"""Webhooks: events POSTed as signed JSON to configured URLs, from an outbox table.

    settings   `[[webhooks]]`: url, secret file, event filter, timeout, retry backoff
    events     which registry events are webhook events, and their names ("version.deployed", ...)
    outbox     the session hook that writes a delivery row in the event's own transaction
    signing    the `Hotswap-Signature` header (timestamp + HMAC-SHA256, the Stripe shape) and its check
    sender     one thread per webhook: posts its deliveries in order, retries with backoff
    report     counts per webhook and state, for /status, `hotswap status` and /metrics

A delivery is written with its event (a daemon killed after the event was recorded still sends
it after its restart), keeps one delivery id across every retry (a receiver drops a repeat), and
is sent by a thread of its own webhook: a slow or failing receiver never waits a rollout.
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.webhooks.outbox import install
    from daemon.webhooks.report import webhook_report
    from daemon.webhooks.service import start_webhooks
    from daemon.webhooks.settings import WebhookSettings, check_webhook_names

__all__ = ["WebhookSettings", "check_webhook_names", "install", "start_webhooks", "webhook_report"]

__getattr__ = public_face(__name__)
