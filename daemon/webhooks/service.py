"""Webhooks in a daemon: the outbox hook on its registry, the sender threads, the metric."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from daemon.common import ConfigError, TokenFileError
from daemon.registry import Registry
from daemon.webhooks.outbox import install
from daemon.webhooks.report import WebhookCollector
from daemon.webhooks.sender import WebhookSender
from daemon.webhooks.settings import WebhookSettings


def start_webhooks(registry: Registry, hooks: list[WebhookSettings], metrics: CollectorRegistry) -> WebhookSender:
    """Deliveries written with their events from now on, and sent; ConfigError for an unusable secret file."""
    for i, hook in enumerate(hooks):
        try:
            WebhookSender.check_secret(hook)
        except TokenFileError as exc:
            raise ConfigError(f"webhooks[{i}].secret_file ({hook.name}): {exc}") from None
    sender = WebhookSender(registry, hooks)
    install(registry, hooks, sender.wake)
    metrics.register(WebhookCollector(registry, hooks))
    sender.start()
    return sender
