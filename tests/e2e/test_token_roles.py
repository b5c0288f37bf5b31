"""Named tokens with roles against a real fleet daemon on PostgreSQL (issue 40): a viewer cannot pin
(403), an operator cannot set the fleet target (403) but pins, an admin sets it; the events and
the fleet target name the token, and the CLI says which token it sent.

The daemon has one external worker whose port nothing listens on: the routes are mounted and the
guard is what is tested; a pin that passes it is recorded (its `pinned` event) whatever the deploy does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import (
    POSTGRES_ENV,
    DaemonProcess,
    _postgres_database,
    hotswap_cli,
    make_config_file,
    wait_until,
)
from sqlalchemy import select
from support_fleet import seed_versions
from support_wait import free_port

from daemon.fleet.target import fleet_target
from daemon.registry import Registry
from daemon.registry.journal import Journal
from daemon.registry.models import Event
from daemon.registry.status import CheckpointStatus as S

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip
TOKENS = {"val": ("viewer", "viewer-secret-0123456789"), "ops": ("operator", "operator-secret-0123456789"),
          "root-admin": ("admin", "admin-secret-0123456789")}  # fmt: skip


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    root = tmp_path_factory.mktemp("roles")
    for url in _postgres_database(os.environ[POSTGRES_ENV]):
        reg = Registry(url, "host-a")
        reg.upgrade()
        ids = seed_versions(reg, root / "ckpts", {"v0": S.DEPLOYED, "v1": S.VERIFIED, "v2": S.VERIFIED})
        Journal(reg).set_alias("last_good", ids["v0"])
        reg.close()
        tokens = []
        for name, (role, secret) in TOKENS.items():
            (root / f"{name}.token").write_text(secret + "\n")
            (root / f"{name}.token").chmod(0o600)
            tokens.append({"name": name, "role": role, "token_file": str(root / f"{name}.token")})
        (root / "worker.token").write_text("worker-secret\n")
        (root / "worker.token").chmod(0o600)
        worker = {"name": "w0", "url": f"http://127.0.0.1:{free_port()}", "token_file": str(root / "worker.token")}
        cfg = make_config_file(root / "config.toml", database={"url": url},
                               daemon={"state_dir": str(root / "state"), "listen": "127.0.0.1:0"},
                               sources=[{"path": str(root / "checkpoints"), "rescan_interval_s": 5.0}],
                               fleet={"host": "host-a", "enabled": True}, workers=[worker],
                               **{"api.tokens": tokens})  # fmt: skip
        d = DaemonProcess(root, cfg, url, root / "checkpoints", root / "state", {})
        try:
            d.start()
            wait_until(lambda d=d: d.get("/v1/rollout").json().get("ready"), 120, 0.2, "the rollout service to be ready")
            yield d
        finally:
            d.close()


def post(d: DaemonProcess, path: str, name: str, body: dict[str, Any]) -> httpx.Response:
    assert d.api_url
    return httpx.post(d.api_url + path, json=body, timeout=60, headers={"Authorization": f"Bearer {TOKENS[name][1]}"})


def events(d: DaemonProcess, kind: str) -> list[dict[str, Any]]:
    with d.registry.session() as s:
        return [e.detail or {} for e in s.scalars(select(Event).where(Event.to_state == kind).order_by(Event.id))]


def test_whoami_names_each_token_and_refuses_an_unknown_one(daemon: DaemonProcess) -> None:
    for name, (role, _) in TOKENS.items():
        assert daemon.get("/v1/whoami", headers={"Authorization": f"Bearer {TOKENS[name][1]}"}).json() == {
            "name": name, "role": role}  # fmt: skip
    assert daemon.get("/v1/whoami", headers={"Authorization": "Bearer nobody-knows-it"}).status_code == 401


def test_a_viewer_cannot_pin(daemon: DaemonProcess) -> None:
    r = post(daemon, "/v1/rollout/pin", "val", {"version": "v1"})
    assert r.status_code == 403, r.text
    assert r.json() == {"error": "token 'val' has role viewer: /v1/rollout/pin needs operator"}
    assert daemon.get("/v1/rollout").json()["pinned"] is None and events(daemon, "pinned") == []


def test_an_operator_cannot_set_the_fleet_target_but_pins_and_pauses(daemon: DaemonProcess, tmp_path: Path) -> None:
    r = post(daemon, "/v1/fleet/target", "ops", {"version": "v1"})
    assert r.status_code == 403 and r.json()["error"] == "token 'ops' has role operator: /v1/fleet/target needs admin"
    op_file = daemon.workdir / "ops.token"
    cli = hotswap_cli("fleet", "target", "v1", "-c", str(daemon.config_path), "--token-file", str(op_file))
    assert cli.returncode == 1 and "needs admin" in cli.stderr and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert fleet_target(Journal(daemon.registry)) is None or not fleet_target(Journal(daemon.registry)).explicit  # type: ignore[union-attr]
    # pause is an operator's: past the guard, refused for what it is (no staged rollout in progress)
    paused = post(daemon, "/v1/fleet/rollout/pause", "ops", {})
    assert paused.status_code == 409 and "no staged fleet rollout" in paused.json()["error"]
    assert post(daemon, "/v1/fleet/rollout/abort", "ops", {}).status_code == 403
    # a pin past the guard is recorded under the token's name, and the CLI says which token it sent
    pin = hotswap_cli("pin", "v0", "-c", str(daemon.config_path), "--token-file", str(op_file), "--timeout", "20")
    assert "[as ops]" in pin.stdout, (pin.stdout, pin.stderr)
    assert {"by": "ops", "force": False} in events(daemon, "pinned")
    again = post(daemon, "/v1/checkpoints/reverify", "ops", {"version": "v2"})  # (rejected then: no files)
    assert again.status_code == 200 and again.json()["by"] == "ops", again.text
    assert any("requested by ops" in str(e.get("message")) for e in events(daemon, "discovered"))


def test_an_admin_sets_the_fleet_target_and_the_event_names_it(daemon: DaemonProcess) -> None:
    admin_file = daemon.workdir / "root-admin.token"
    cli = hotswap_cli("fleet", "target", "v1", "-c", str(daemon.config_path), "--token-file", str(admin_file))
    assert cli.returncode == 0, cli.stderr
    assert "set by root-admin" in cli.stdout
    target = fleet_target(Journal(daemon.registry))
    assert target is not None and target.explicit and target.set_by == "root-admin"
    assert any(e.get("by") == "root-admin" and e.get("version") == "v1" for e in events(daemon, "fleet_target_set"))
    cleared = post(daemon, "/v1/fleet/target", "root-admin", {"version": None})
    assert cleared.status_code == 200 and cleared.json() == {"version": None, "by": "root-admin"}
    assert {"by": "root-admin"} in events(daemon, "fleet_target_cleared")


def test_a_named_token_file_open_to_others_refuses_the_start(tmp_path: Path) -> None:
    from daemon.common.auth import TokenFileError, build_guard
    from daemon.common.tokens import TokenSpec

    loose = tmp_path / "loose.token"
    loose.write_text("a-token-others-can-read\n")
    loose.chmod(0o644)
    with pytest.raises(TokenFileError, match=r"^api.tokens\[0\].token_file \(bob\): token file .* is open to other users"):
        build_guard(tmp_path / "state", [TokenSpec("bob", "operator", str(loose))])
    loose.chmod(0o600)
    same = tmp_path / "same.token"
    same.write_text("a-token-others-can-read\n")
    same.chmod(0o600)
    with pytest.raises(TokenFileError, match="bob and eve hold the same token"):
        build_guard(tmp_path / "state", [TokenSpec("bob", "operator", str(loose)), TokenSpec("eve", "viewer", str(same))])
