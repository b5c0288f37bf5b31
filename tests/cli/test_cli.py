"""The `hotswap` entry point: dispatch, history/status output, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import hotswap_cli, make_config_file, publish_tiny

from daemon.cli.main import DELEGATED, main


def test_help_lists_every_command():
    out = hotswap_cli("--help")
    assert out.returncode == 0
    for cmd in ("daemon", "history", "status", "db", *DELEGATED):
        assert cmd in out.stdout


def test_delegated_commands_parse_their_own_arguments(tmp_path):
    out = hotswap_cli("publish", "--help")
    assert out.returncode == 0 and "--version" in out.stdout
    publish_dir = tmp_path / "c"
    from daemon.tinymodel import make_tiny_checkpoint

    make_tiny_checkpoint(publish_dir, seed=1)
    out = hotswap_cli("publish", str(publish_dir), "--version", "cli-1")
    assert out.returncode == 0, out.stderr
    assert json.loads((publish_dir / "hotswap-manifest.json").read_text())["version"] == "cli-1"
    out = hotswap_cli("verify", str(publish_dir))
    assert out.returncode == 0, out.stdout + out.stderr


# Operator commands that never touch weights: none of them may pay for importing torch (~1 s).
LIGHT_COMMANDS = ("publish", "push", "rollback", "pin", "unpin", "reverify", "fleet")


@pytest.mark.parametrize("command", LIGHT_COMMANDS)
def test_operator_commands_do_not_import_torch(command):
    module = DELEGATED[command][0].split(":")[0]
    code = f"import sys, daemon.cli.main, {module}; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", f"hotswap {command} ({module}) imports {out.stdout.strip()}"


def test_unknown_command_is_an_error(capsys):
    try:
        main(["frobnicate"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_history_and_status_on_a_registry(db_url, daemon_factory, tmp_path):
    d = daemon_factory(db_url)
    publish_tiny(tmp_path / "a", seed=1, version="h-1")
    shutil.copytree(tmp_path / "a", d.watch_dir / "h-1")
    d.wait_status("h-1", "verified")
    d.stop()

    table = hotswap_cli("history", "-c", str(d.config_path), env={"COLUMNS": "200"})
    assert table.returncode == 0, table.stderr
    line = next(ln for ln in table.stdout.splitlines() if "h-1" in ln)
    assert "verified" in line and "KB" in line

    status = hotswap_cli("status", "--json", "-c", str(d.config_path))
    doc = json.loads(status.stdout)
    assert doc["checkpoints"] == {"verified": 1}
    assert doc["daemon"]["running"] is False
    assert doc["latest"][0]["version"] == "h-1"


def test_history_before_any_daemon_ran_refuses_to_create_a_database(tmp_path):
    cfg = make_config_file(tmp_path / "c.toml", daemon={"state_dir": str(tmp_path / "state")})
    out = hotswap_cli("history", "--json", "-c", str(cfg))
    assert out.returncode == 2
    assert out.stdout == ""
    assert str(tmp_path / "state" / "hotswap.db") in out.stderr and "--state-dir" in out.stderr
    assert not (tmp_path / "state").exists()


def test_status_says_when_an_alias_names_a_version_whose_files_are_gone(tmp_path, capsys):
    """A pinned version whose directory was deleted holds every new checkpoint back, and no
    rollout can reach it: `hotswap status` says so beside the alias (and /status in alias_problems)."""
    from support_fleet import seed_versions

    from daemon.registry import Registry
    from daemon.registry.journal import Journal
    from daemon.registry.status import CheckpointStatus as S

    state = tmp_path / "state"
    state.mkdir()
    reg = Registry(f"sqlite:///{state / 'hotswap.db'}")
    reg.upgrade()
    ids = seed_versions(reg, tmp_path / "ckpts", {"v1": S.DEPLOYED, "v2": S.VERIFIED})
    journal = Journal(reg)
    for alias in ("serving", "last_good"):
        journal.set_alias(alias, ids["v1"])
    journal.set_alias("pinned", ids["v2"])
    reg.close()
    shutil.rmtree(tmp_path / "ckpts" / "v2")
    cfg = make_config_file(tmp_path / "c.toml", daemon={"state_dir": str(state)})
    assert main(["status", "-c", str(cfg)]) == 3  # the registry read; no daemon runs (documented)
    lines = capsys.readouterr().out.splitlines()
    gone = str(tmp_path / "ckpts" / "v2")
    assert f"pinned:      v2  (cannot be deployed here: its directory {gone} is missing)" in lines, lines
    assert "serving:     v1" in lines and "last_good:   v1" in lines
    assert main(["status", "--json", "-c", str(cfg)]) == 3
    assert json.loads(capsys.readouterr().out)["alias_problems"] == {"pinned": f"its directory {gone} is missing"}


def test_status_says_that_newer_versions_wait_for_the_pin(tmp_path, capsys):
    """While pinned, `hotswap status` says what waits (issue 36): the verified versions the pin holds."""
    from support_fleet import seed_versions

    from daemon.registry import Registry
    from daemon.registry.journal import Journal
    from daemon.registry.status import CheckpointStatus as S

    state = tmp_path / "state"
    state.mkdir()
    reg = Registry(f"sqlite:///{state / 'hotswap.db'}")
    reg.upgrade()
    ids = seed_versions(reg, tmp_path / "ckpts", {"v1": S.DEPLOYED, "v2": S.VERIFIED, "v3": S.VERIFIED})
    journal = Journal(reg)
    for alias in ("serving", "last_good", "pinned"):
        journal.set_alias(alias, ids["v1"])
    reg.close()
    cfg = make_config_file(tmp_path / "c.toml", daemon={"state_dir": str(state)})
    main(["status", "-c", str(cfg)])
    lines = capsys.readouterr().out.splitlines()
    pinned = next(ln for ln in lines if ln.startswith("pinned:"))
    assert pinned.startswith("pinned:      v1  (newer versions wait for the pin (v3, v2)"), pinned
    assert "`hotswap unpin`" in pinned
