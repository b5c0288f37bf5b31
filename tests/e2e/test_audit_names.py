"""Audit names come from the credential, never from the environment (issue 37, item 7): `hotswap
fleet target` run as a real process with `LOGNAME=alice` records "control-token" when the caller
holds the control token, and the kernel's uid otherwise, never "alice"."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import POSTGRES_ENV, _postgres_database, hotswap_cli, make_config_file
from support_fleet import seed_versions

from daemon.common.auth import ensure_control_token
from daemon.fleet.target import fleet_target
from daemon.registry import Registry
from daemon.registry.journal import Journal
from daemon.registry.status import CheckpointStatus as S

pytestmark = pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Path, Registry]]:
    for url in _postgres_database(os.environ[POSTGRES_ENV]):
        reg = Registry(url, "host-a")
        reg.upgrade()
        ids = seed_versions(reg, tmp_path / "ckpts", {"v0": S.DEPLOYED, "v1": S.VERIFIED})
        Journal(reg).set_alias("last_good", ids["v0"])
        config = make_config_file(tmp_path / "hotswap.toml", database={"url": url},
                                  daemon={"state_dir": str(tmp_path / "state")},
                                  fleet={"host": "host-b", "enabled": True})  # fmt: skip
        yield config, reg
        reg.close()


def _set_by(reg: Registry) -> str:
    t = fleet_target(Journal(reg))
    assert t is not None
    return str(t.set_by)


def test_the_audit_name_is_the_credential_not_logname(fleet: tuple[Path, Registry], tmp_path: Path) -> None:
    config, reg = fleet
    forged = {"LOGNAME": "alice", "USER": "alice", "LNAME": "alice", "USERNAME": "alice"}
    done = hotswap_cli("fleet", "target", "v1", "-c", str(config), env=forged)
    assert done.returncode == 0, done.stderr
    assert "alice" not in _set_by(reg) and f"uid:{os.getuid()}" in _set_by(reg), _set_by(reg)
    ensure_control_token(tmp_path / "state")  # the operator holds the control token
    done = hotswap_cli("fleet", "target", "v0", "-c", str(config), env=forged)
    assert done.returncode == 0, done.stderr
    assert _set_by(reg).startswith("cli:control-token@"), _set_by(reg)


def test_a_forged_lease_row_neither_crashes_status_nor_blocks_a_slot(fleet: tuple[Path, Registry]) -> None:
    """A lease expiring at 'infinity' crashed `status --fleet`; one a century ahead blocked every
    host. Both are read as no lease: status answers, and a host takes the slot."""
    from sqlalchemy import text

    from daemon.fleet.lease import FleetLeases
    from daemon.fleet.settings import FleetSettings

    config, reg = fleet
    with reg.session() as s:
        s.execute(text("INSERT INTO fleet_leases (slot, host, version, acquired_at, expires_at) VALUES "
                       "(0, 'mallory', 'v1', now(), now() + interval '100 years'), (1, 'mallory', 'v1', now(), 'infinity')"))  # fmt: skip
    done = hotswap_cli("status", "--fleet", "-c", str(config))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    leases = FleetLeases(reg, FleetSettings(enabled=True, host="host-a", max_updating_hosts=1))
    assert leases.try_acquire("v1") == 0  # the one slot, "held" a century ahead: free
