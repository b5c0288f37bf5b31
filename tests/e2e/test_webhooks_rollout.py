"""Webhooks of a real rollout (issue 40): a daemon with a real worker on PostgreSQL (SQLite too)
deploys v1, an operator's named token rolls it back, and the receiver gets v1's verified,
deployed and rolled-back events in that order, signed, the last naming the token."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, hotswap_cli, wait_until
from support_rollout import WorkerPool, aliases, assert_fleet_on, publish_into, start_fleet
from support_webhooks import Receiver, check_deliveries, hook, receiving, secret_file

pytestmark = pytest.mark.timeout(600)
FEW_CHECKS = {"enabled": ["manifest", "headers", "crc32c"]}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path_factory.mktemp("pool"), n=1)
    yield p
    p.close()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    yield from receiving(tmp_path)


def test_a_rollout_and_a_named_rollback_reach_the_receiver_in_order(
        db_url: str, pool: WorkerPool, daemon_factory: Callable[..., DaemonProcess], receiver: Receiver,
        tmp_path: Path) -> None:  # fmt: skip
    ops = tmp_path / "ops.token"
    ops.write_text("ops-token-0123456789\n")
    ops.chmod(0o600)
    extra: dict[str, Any] = {"webhooks": [hook("ops", receiver.url, secret_file(tmp_path))],
                             "api.tokens": [{"name": "ops", "role": "operator", "token_file": str(ops)}]}  # fmt: skip
    d = start_fleet(daemon_factory, db_url, pool, rollout={"health_window_s": 0.3}, checks=FEW_CHECKS, extra=extra)
    publish_into(d.watch_dir, "v1", seed=1)
    d.wait_status("v1", "deployed", timeout=180)
    wait_until(lambda: aliases(d.registry).get("last_good") == "v1", 60, what="v1's health window")
    back = hotswap_cli("rollback", "-c", str(d.config_path), "--token-file", str(ops))
    assert back.returncode == 0 and "[as ops]" in back.stdout, (back.stdout, back.stderr)
    assert_fleet_on(pool.workers, "v0")

    def of_v1() -> list[str]:
        return [json.loads(x["body"])["event"] for x in receiver.accepted() if json.loads(x["body"])["version"] == "v1"]

    wait_until(lambda: "version.rolled_back" in of_v1(), 60, 0.1, "v1's rolled_back webhook")
    assert of_v1() == ["version.verified", "version.deployed", "version.rolled_back"]
    payloads = check_deliveries(receiver)
    rolled = next(p for p in payloads if p["event"] == "version.rolled_back")
    assert rolled["detail"] == {"to": "v0", "by": "ops"}
