"""`hotswap fleet target`: an operator reads, sets and clears the fleet's target on the shared
PostgreSQL registry; unknown, unverified and rejected versions are refused and change nothing;
a config without fleet mode is refused in one line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import POSTGRES_ENV, _postgres_database, make_config_file
from support_fleet import seed_versions

from daemon.cli.main import main
from daemon.fleet.target import fleet_target
from daemon.registry import Registry
from daemon.registry.journal import Journal
from daemon.registry.models import Checkpoint
from daemon.registry.status import CheckpointStatus as S

pytestmark = [pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}"), pytest.mark.quick]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Path, Registry]]:
    for url in _postgres_database(os.environ[POSTGRES_ENV]):
        reg = Registry(url, "host-a")
        reg.upgrade()
        ids = seed_versions(reg, tmp_path / "ckpts", {"v0": S.DEPLOYED, "v1": S.VERIFIED, "v2": S.REJECTED,
                                                  "v3": S.VERIFYING})  # fmt: skip
        with reg.session() as s:
            s.get_one(Checkpoint, ids["v2"]).status_message = "finite: NaN in model.layers.0.mlp.up_proj.weight"
        Journal(reg).set_alias("last_good", ids["v0"])
        config = make_config_file(tmp_path / "hotswap.toml", database={"url": url},
                                  daemon={"state_dir": str(tmp_path / "state")},
                                  fleet={"host": "host-b", "enabled": True})  # fmt: skip
        yield config, reg
        reg.close()


def target(reg: Registry) -> tuple[str | None, bool]:
    t = fleet_target(Journal(reg))
    return (t.checkpoint.version, t.explicit) if t else (None, False)


def test_set_read_and_clear_the_fleet_target(fleet: tuple[Path, Registry], capsys: pytest.CaptureFixture[str]) -> None:
    config, reg = fleet
    assert main(["fleet", "target", "-c", str(config)]) == 0
    assert capsys.readouterr().out.strip() == "fleet target: v0 (newest last_good)"
    assert main(["fleet", "target", "v1", "-c", str(config)]) == 0  # held on a verified version
    out = capsys.readouterr().out
    assert out.startswith("fleet target: v1 (explicit, set by cli:") and "@" in out
    assert target(reg) == ("v1", True)
    assert main(["fleet", "target", "--json", "-c", str(config)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == "v1" and doc["explicit"] is True and doc["set_by"].startswith("cli:") and doc["set_at"]
    assert main(["fleet", "target", "v0", "-c", str(config)]) == 0  # an older one: allowed, moved
    assert target(reg) == ("v0", True)
    assert main(["fleet", "target", "--clear", "-c", str(config)]) == 0
    assert "newest last_good" in capsys.readouterr().out
    assert target(reg) == ("v0", False)
    assert main(["fleet", "target", "--clear", "-c", str(config)]) == 0  # clearing twice is fine


@pytest.mark.parametrize(("version", "says"), [
    ("v2", "'v2' is rejected (finite: NaN in model.layers.0.mlp.up_proj.weight)"),
    ("v3", "'v3' is verifying"),
    ("v9", "unknown version 'v9'"),
])  # fmt: skip
def test_a_version_that_cannot_be_the_target_is_refused_and_changes_nothing(
    fleet: tuple[Path, Registry], capsys: pytest.CaptureFixture[str], version: str, says: str
) -> None:
    config, reg = fleet
    assert main(["fleet", "target", "v1", "-c", str(config)]) == 0
    capsys.readouterr()
    assert main(["fleet", "target", version, "-c", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hotswap fleet: error: ") and says in err and err.count("\n") == 1
    assert target(reg) == ("v1", True)  # the operator's earlier target stands


def test_without_fleet_mode_or_with_both_arguments_it_is_refused_in_one_line(
    fleet: tuple[Path, Registry], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, reg = fleet
    assert main(["fleet", "target", "v1", "--clear", "-c", str(config)]) == 2
    assert "not both" in capsys.readouterr().err
    single = make_config_file(tmp_path / "single.toml", database={"url": str(reg.engine.url.render_as_string(False))},
                              daemon={"state_dir": str(tmp_path / "state")})  # fmt: skip
    assert main(["fleet", "target", "v1", "-c", str(single)]) == 2
    err = capsys.readouterr().err
    assert "[fleet] enabled is false" in err and "hotswap pin VERSION" in err and err.count("\n") == 1
    assert target(reg) == ("v0", False)  # nothing written


def test_fleet_rollout_without_a_staged_rollout_says_so_and_steering_it_is_refused(
    fleet: tuple[Path, Registry], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, reg = fleet
    assert main(["fleet", "rollout", "-c", str(config)]) == 0
    assert "no staged fleet rollout yet" in capsys.readouterr().out
    for action in ("pause", "resume", "abort"):  # nothing in progress: refused in one line, nothing written
        assert main(["fleet", "rollout", action, "-c", str(config)]) == 1
        err = capsys.readouterr().err
        assert "no staged fleet rollout in progress" in err and err.count("\n") == 1, err
    assert main(["fleet", "rollout", "--json", "-c", str(config)]) == 0
    assert json.loads(capsys.readouterr().out) is None
    single = make_config_file(tmp_path / "single.toml", database={"url": str(reg.engine.url.render_as_string(False))},
                              daemon={"state_dir": str(tmp_path / "state")})  # fmt: skip
    assert main(["fleet", "rollout", "pause", "-c", str(single)]) == 2
    assert "[fleet] enabled is false" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: an unknown action names the choices
        main(["fleet", "rollout", "halt", "-c", str(config)])
    assert "invalid choice: 'halt'" in capsys.readouterr().err
