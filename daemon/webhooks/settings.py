"""`[[webhooks]]`: where events are POSTed, signed with what, which ones, how patiently.

```toml
[[webhooks]]
name = "ops-alerts"                          # names the webhook in /status, metrics and logs
url = "https://alerts.internal/hotswap"      # http(s); the JSON body is POSTed here
secret_file = "/etc/hotswap/webhook.secret"  # HMAC-SHA256 key, one line, 0600 ("" = unsigned)
events = ["version.rejected", "rollout.halted", "problem.started"]  # [] = every event
timeout_s = 10.0                             # one POST, connect to last byte
retry_initial_s = 5.0                        # first retry after this; doubles each failure
retry_max_s = 600.0                          # up to this between tries
max_attempts = 50                            # then the delivery is undeliverable (kept, counted)
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from daemon.common import ConfigError
from daemon.webhooks.events import WEBHOOK_EVENTS


@dataclass
class WebhookSettings:
    name: str = ""  # names the webhook in /status, metrics and logs (letters, digits, . _ -)
    url: str = ""  # http(s) URL the events are POSTed to
    secret_file: str = ""  # HMAC-SHA256 key (one line, 0600, this user's); "" = unsigned
    events: list[str] = field(default_factory=list)  # which events ([] = all; daemon.webhooks.events)
    timeout_s: float = 10.0  # one POST, connect to last byte
    retry_initial_s: float = 5.0  # the first retry waits this long; each failure doubles it
    retry_max_s: float = 600.0  # the longest wait between two tries
    max_attempts: int = 50  # tries before a delivery is undeliverable (it is kept and counted)

    def validate(self, key: str) -> None:
        if not self.name or len(self.name) > 64 or not all(c.isalnum() or c in "._-" for c in self.name):
            raise ValueError(f"{key}.name: {self.name!r} is not a webhook name (1-64 of letters, digits, . _ -)")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{key}.url: {self.url!r} is not an http(s) URL")
        for i, ev in enumerate(self.events):
            if ev not in WEBHOOK_EVENTS:
                raise ValueError(f"{key}.events[{i}]: {ev!r} is not one of {', '.join(WEBHOOK_EVENTS)}")
        if self.timeout_s <= 0 or self.retry_initial_s <= 0 or self.retry_max_s < self.retry_initial_s:
            raise ValueError(f"{key}: timeout_s and retry_initial_s must be > 0, retry_max_s >= retry_initial_s")
        if self.max_attempts < 1:
            raise ValueError(f"{key}.max_attempts: must be >= 1")

    def wants(self, event: str) -> bool:
        return not self.events or event in self.events


def check_webhook_names(hooks: list[WebhookSettings]) -> None:
    names = [h.name for h in hooks]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"webhooks[{i}].name: {name!r} is used by two webhooks")
