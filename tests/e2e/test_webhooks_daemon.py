"""Webhooks from a real daemon to a real receiver process (issue 40), on SQLite and PostgreSQL:
signed, in order per version, none lost across a SIGKILL and restart, each under one delivery
id; a receiver that answers 500 for a while gets them all afterwards; one that never answers is
counted as undeliverable in `hotswap status` and /metrics."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, hotswap_cli, publish_tiny, wait_until
from support_webhooks import Receiver, check_deliveries, hook, receiving, secret_file, verified

pytestmark = pytest.mark.timeout(400)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    yield from receiving(tmp_path)
CHECKS = {"enabled": ["manifest", "headers", "crc32c"]}  # the verdicts are what is sent; no torch needed


def publish(d: DaemonProcess, tmp_path: Path, version: str, seed: int) -> None:
    publish_tiny(tmp_path / "build" / version, seed=seed, version=version)
    shutil.copytree(tmp_path / "build" / version, d.watch_dir / version)


def test_webhooks_survive_a_sigkill_signed_in_order_and_once(db_url: str, daemon_factory: Any, receiver: Receiver,
                                                             tmp_path: Path) -> None:  # fmt: skip
    d = daemon_factory(db_url, checks=CHECKS, extra={"webhooks": [hook("ops", receiver.url, secret_file(tmp_path))]})
    publish(d, tmp_path, "v1", 1)
    wait_until(lambda: "v1" in verified(receiver), 90, 0.1, "v1's verified webhook")
    receiver.failing(True)
    publish(d, tmp_path, "v2", 2)
    publish(d, tmp_path, "v3", 3)
    d.wait_status("v3", "verified")
    d.wait_status("v2", "verified")
    wait_until(lambda: any(x["status"] == 500 for x in receiver.lines()), 30, 0.1, "a refused delivery")
    again = hotswap_cli("reverify", "v2", "-c", str(d.config_path), "--timeout", "60")  # v2 verified twice
    assert again.returncode == 0, again.stderr
    d.kill()  # SIGKILL: v2 and v3's deliveries are pending in the outbox, none accepted yet
    assert set(verified(receiver)) == {"v1"}
    publish(d, tmp_path, "v4", 4)  # arrives while the daemon is down
    receiver.failing(False)
    d.start()
    wait_until(lambda: sorted(verified(receiver)) == ["v1", "v2", "v2", "v3", "v4"], 120, 0.1, "every version's webhook")
    payloads = check_deliveries(receiver)  # v2's two in the order they happened
    assert [p["event"] for p in payloads] == ["version.verified"] * 5
    with d.registry.session() as s:
        from sqlalchemy import select

        from daemon.registry.webhook_rows import WebhookDelivery

        rows = s.scalars(select(WebhookDelivery)).all()
        assert sorted(r.delivery_id for r in rows) == sorted(p["id"] for p in payloads)
        assert {r.state for r in rows} == {"delivered"}
        assert max(r.attempts for r in rows if r.version in ("v2", "v3")) >= 2  # refused before the kill


def test_a_receiver_answering_500_for_a_while_gets_them_all_and_a_dead_one_is_counted(
        db_url: str, daemon_factory: Any, receiver: Receiver, tmp_path: Path) -> None:  # fmt: skip
    secret = secret_file(tmp_path)
    dead = hook("dead", "http://127.0.0.1:9/never", secret, max_attempts=2)  # port 9: nothing listens
    d = daemon_factory(db_url, checks=CHECKS, extra={"webhooks": [hook("ops", receiver.url, secret), dead]})
    receiver.failing(True)
    for i, v in enumerate(("v1", "v2", "v3")):
        publish(d, tmp_path, v, i + 1)
    wait_until(lambda: sum(x["status"] == 500 for x in receiver.lines()) >= 3, 90, 0.1, "three refused tries")
    status = hotswap_cli("status", "-c", str(d.config_path))
    assert "webhook:     ops 0 delivered" in status.stdout and "retrying" in status.stdout, status.stdout
    receiver.failing(False)
    wait_until(lambda: sorted(verified(receiver)) == ["v1", "v2", "v3"], 90, 0.1, "every version after the outage")
    check_deliveries(receiver)

    def undeliverable() -> bool:
        text = d.get("/metrics").text
        return 'hotswap_webhook_deliveries{state="undeliverable",webhook="dead"} 3.0' in text
    wait_until(undeliverable, 60, 0.2, "the dead webhook's deliveries counted undeliverable")
    status = hotswap_cli("status", "-c", str(d.config_path))
    assert "webhook:     dead 0 delivered, 0 pending (0 retrying), 3 undeliverable; last error: ConnectError" in status.stdout, status.stdout
    assert "webhook:     ops 3 delivered, 0 pending" in status.stdout


def test_a_receiver_that_hangs_holds_back_its_webhook_never_the_daemon(db_url: str, daemon_factory: Any,
                                                                       receiver: Receiver, tmp_path: Path) -> None:  # fmt: skip
    (receiver.root / "slow").touch()
    d = daemon_factory(db_url, checks=CHECKS, extra={"webhooks": [hook("ops", receiver.url, secret_file(tmp_path),
                                                                       timeout_s=60.0)]})  # fmt: skip
    publish(d, tmp_path, "v1", 1)
    started = receiver.root / "started.jsonl"
    wait_until(lambda: started.exists() and started.read_text().strip(), 90, 0.1, "v1's delivery held open")
    publish(d, tmp_path, "v2", 2)  # verified while the receiver still holds v1's delivery
    d.wait_status("v2", "verified")
    assert receiver.lines() == [] and len(started.read_text().splitlines()) == 1  # still the one, open
    assert d.get("/health").status_code == 200
    (receiver.root / "slow").unlink()
    wait_until(lambda: verified(receiver) == ["v1", "v2"], 60, 0.1, "both, in order, once it answers")
    check_deliveries(receiver)
