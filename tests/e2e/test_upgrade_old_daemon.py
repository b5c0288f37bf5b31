"""Rolling upgrades (issue 28): migrations are additive first, so a daemon of the release before
them keeps working while a newer hotswap migrates the database under it, and a daemon runs on a
database a newer release migrated (its revision unknown here) as it is. SQLite and PostgreSQL.

The previous release is the repository's own history: commit OLD_COMMIT (main before this round,
its migrations inside the package, head 0005_fleet_hosts: this round adds 0006 to 0013), taken
out with `git archive` and run from that folder with this venv. It needs a clone with
history (CI has one); without it the test fails, naming why.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import REPO, hotswap_cli, make_config_file, publish_tiny, wait_until
from sqlalchemy import text

from daemon.registry import Registry

OLD_COMMIT = "8367bbb"
OLD_HEAD = "0005_fleet_hosts"
CHECKS = {"enabled": ["manifest", "headers", "crc32c", "compat", "finite"]}


def _head() -> str:
    from alembic.script import ScriptDirectory

    from daemon.registry.db import alembic_config

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp(f"hotswap-{OLD_COMMIT}")
    tar = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", OLD_COMMIT, "daemon"],
                         capture_output=True)  # fmt: skip
    if tar.returncode != 0:
        pytest.fail(f"git archive {OLD_COMMIT} failed: this test runs the previous release from the repository's "
                    f"history (a full clone): {tar.stderr.decode().strip()}", pytrace=False)  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar.stdout, check=True)
    assert (dest / "daemon" / "migrations" / "versions" / f"{OLD_HEAD}.py").exists()
    assert not (dest / "daemon" / "migrations" / "versions" / f"{_head()}.py").exists()
    return dest


def test_the_previous_release_keeps_working_while_its_database_is_migrated(db_url, daemon_factory, old_tree):
    old = daemon_factory(db_url, checks=CHECKS, env={"PYTHONPATH": str(old_tree)}, wait=False)
    old.module = "daemon.cli"  # that release's CLI was one module
    old.start()  # it migrates to its own head
    assert old.registry.current_revision() == OLD_HEAD
    publish_tiny(old.watch_dir / "v1", seed=1, version="v1")

    def v1_status() -> str | None:  # read as plain SQL: this release's queries need its own schema
        with old.registry.engine.connect() as c:
            return c.execute(text("SELECT status FROM checkpoints WHERE version = 'v1'")).scalar_one_or_none()

    wait_until(lambda: v1_status() == "verified", 60, 0.1, "v1 verified by the old daemon")

    up = hotswap_cli("db", "upgrade", "-c", str(old.config_path))  # this release, while the old daemon runs
    assert up.returncode == 0, up.stderr
    assert old.registry.current_revision() == _head()

    publish_tiny(old.watch_dir / "v2", seed=2, version="v2")  # recorded, checked and answered by the old code
    row = old.wait_status("v2", "verified", timeout=60)
    assert row["verify_ms"] is not None and row["rollout_count"] == 0
    doc = old.get("/status").json()  # its /status reads version_history (the new view) through its own queries
    assert [r["version"] for r in doc["latest"]][:2] == ["v2", "v1"] and doc["checkpoints"] == {"verified": 2}
    assert old.get("/health").status_code == 200 and old.alive()
    with old.registry.engine.connect() as c:
        checks = c.execute(text("SELECT COUNT(*) FROM checks k JOIN checkpoints c ON c.id = k.checkpoint_id "
                                "WHERE c.version = 'v2'")).scalar_one()  # fmt: skip
    assert checks == len(CHECKS["enabled"])


def test_a_database_a_newer_release_migrated_is_used_as_it_is(db_url: str, tmp_path: Path) -> None:
    reg = Registry(db_url)
    reg.upgrade()
    with reg.engine.begin() as c:  # as if a newer release had added its own (expand-only) revision
        c.execute(text("UPDATE alembic_version SET version_num = '0099_from_a_newer_release'"))
    reg.upgrade()  # no "Can't locate revision": a warning, and the schema as it is
    assert reg.current_revision() == "0099_from_a_newer_release"
    cfg = make_config_file(tmp_path / "c.toml", daemon={"state_dir": str(tmp_path / "state")}, database={"url": db_url})
    for argv in (("history",), ("status",), ("db", "upgrade")):
        out = hotswap_cli(*argv, "-c", str(cfg), cwd=tmp_path)
        # status reads the registry and says so, then exits 3: no daemon runs here (docs/reference/cli.md)
        assert out.returncode == (3 if argv == ("status",) else 0), (argv, out.stdout, out.stderr)
    assert "database_newer_than_this_daemon" in out.stdout + out.stderr
    reg.close()
