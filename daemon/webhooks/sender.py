"""One thread per webhook: its pending deliveries of this host, oldest first, each POSTed until the
receiver answers 2xx, retried with exponential backoff, given up (`undeliverable`) after
`max_attempts`. Head of line: a delivery waits for the ones before it, so a receiver sees a
version's events in the order they happened. A delivery sent and not yet marked when the daemon
dies is sent again after the restart under the same delivery id (at least once; the receiver
drops the repeat)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import httpx
from sqlalchemy import select, update

import daemon
from daemon.common import backoff_delay, get_logger, read_private_token_file
from daemon.registry import Registry, WebhookDelivery, utcnow
from daemon.webhooks.settings import WebhookSettings
from daemon.webhooks.signing import DELIVERY_HEADER, EVENT_HEADER, SIGNATURE_HEADER, sign

log = get_logger(__name__)
IDLE_POLL_S = 5.0  # with nothing due: look again this often (a commit here wakes it sooner)


def read_secret(hook: WebhookSettings) -> bytes:
    """The webhook's HMAC key (TokenFileError, one line, when the file is missing or not private)."""
    return read_private_token_file(Path(hook.secret_file).expanduser()).encode() if hook.secret_file else b""


class WebhookSender:
    def __init__(self, registry: Registry, hooks: list[WebhookSettings]) -> None:
        self.registry = registry
        self.hooks = hooks
        self._secrets = {h.name: read_secret(h) for h in hooks}  # read now: a bad file fails the start
        self._stop = threading.Event()
        self._wake = {h.name: threading.Event() for h in hooks}
        self._threads = [threading.Thread(target=self._run, args=(h,), name=f"webhook-{h.name}", daemon=True)
                         for h in hooks]  # fmt: skip

    @staticmethod
    def check_secret(hook: WebhookSettings) -> None:
        read_secret(hook)

    def wake(self) -> None:
        for ev in self._wake.values():
            ev.set()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        for t in self._threads:
            t.join(timeout=max(h.timeout_s for h in self.hooks) + 5)

    def _run(self, hook: WebhookSettings) -> None:
        with httpx.Client(timeout=hook.timeout_s, follow_redirects=False) as client:
            while not self._stop.is_set():
                try:
                    wait_s = self._send_next(hook, client)
                except Exception as exc:  # noqa: BLE001 - the database away: try again, never die
                    log.warning("webhook outbox unreadable", webhook=hook.name, error=str(exc))
                    wait_s = IDLE_POLL_S
                if wait_s > 0:
                    self._wake[hook.name].wait(wait_s)
                    self._wake[hook.name].clear()

    def _send_next(self, hook: WebhookSettings, client: httpx.Client) -> float:
        """Send the oldest pending delivery if due; seconds to wait before the next look (0: at once)."""
        with self.registry.session() as s:
            row = s.scalars(select(WebhookDelivery).where(
                WebhookDelivery.host == self.registry.host, WebhookDelivery.webhook == hook.name,
                WebhookDelivery.state == "pending").order_by(WebhookDelivery.id).limit(1)).first()  # fmt: skip
        if row is None:
            return IDLE_POLL_S
        due_in = (row.next_attempt_at - utcnow()).total_seconds()
        if due_in > 0:
            return min(due_in, IDLE_POLL_S)
        status, error = self._post(hook, client, row)
        attempts = row.attempts + 1
        values: dict[str, object] = {"attempts": attempts, "last_status": status, "last_error": error}
        if error is None:
            values.update(state="delivered", delivered_at=utcnow())
        elif attempts >= hook.max_attempts:
            values.update(state="undeliverable")
            log.warning("webhook_undeliverable", webhook=hook.name, delivery=row.delivery_id, kind=row.event,
                        version=row.version, attempts=attempts, error=error)  # fmt: skip
        else:
            delay = backoff_delay(attempts, hook.retry_initial_s, hook.retry_max_s)
            values.update(next_attempt_at=utcnow() + timedelta(seconds=delay))
            log.info("webhook_retry", webhook=hook.name, delivery=row.delivery_id, attempts=attempts,
                     retry_in_s=round(delay, 2), error=error)  # fmt: skip
        with self.registry.session() as s:
            s.execute(update(WebhookDelivery).where(WebhookDelivery.id == row.id).values(**values))
        return 0.0

    def _post(self, hook: WebhookSettings, client: httpx.Client, row: WebhookDelivery) -> tuple[int | None, str | None]:
        body = json.dumps(row.payload, separators=(",", ":"), sort_keys=True).encode()
        headers = {"Content-Type": "application/json", "User-Agent": f"hotswap/{daemon.__version__}",
                   DELIVERY_HEADER: row.delivery_id, EVENT_HEADER: row.event}  # fmt: skip
        secret = self._secrets[hook.name]
        if secret:
            headers[SIGNATURE_HEADER] = sign(secret, body)
        try:
            r = client.post(hook.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:500]
        if 200 <= r.status_code < 300:
            return r.status_code, None
        return r.status_code, f"HTTP {r.status_code}: {r.text[:200]}"
