"""Packaging: migrations at the repository root (shipped inside the wheel), `alembic upgrade head` from the repository, --version.

The whole-wheel check (build, install into a venv outside the repository, start the daemon from
an empty folder) is scripts/check-wheel.sh, run by .ci/run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from conftest import REPO, hotswap_cli, make_config_file
from sqlalchemy import create_engine, inspect

import daemon
from daemon.registry import Registry
from daemon.registry.db import MIGRATIONS, alembic_config


def _alembic(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"}
    return subprocess.run([sys.executable, "-m", "alembic", "-c", str(REPO / "alembic.ini"), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _head() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _revision(url: str) -> str | None:
    reg = Registry(url)
    try:
        return reg.current_revision()
    finally:
        reg.close()


def test_migrations_live_at_the_repository_root() -> None:
    # the source tree keeps them at the top (migrations/); setup.py maps that folder into the
    # wheel as daemon.migrations (scripts/check-wheel.sh proves the installed side)
    where = Path(str(MIGRATIONS))
    assert where == REPO / "migrations"
    assert (where / "env.py").is_file() and (where / "script.py.mako").is_file()
    assert sorted(p.name for p in (where / "versions").glob("0*.py"))[:2] == ["0001_initial.py", "0002_rollout_views.py"]
    assert not (Path(daemon.__file__).parent / "migrations").exists(), "a second copy of the migrations inside daemon/"


def test_alembic_upgrade_head_without_url_uses_the_default_database(tmp_path: Path) -> None:
    # issue 9: env.py read `[database] url` (empty by default) and gave alembic an empty URL
    out = _alembic("upgrade", "head", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    db = tmp_path / "state" / "hotswap.db"
    assert db.is_file()
    assert _revision(f"sqlite:///{db}") == _head()


def test_alembic_upgrade_head_with_a_config_that_leaves_the_url_default(tmp_path: Path) -> None:
    state = tmp_path / "elsewhere"
    cfg = make_config_file(tmp_path / "c.toml", daemon={"state_dir": str(state)})
    out = _alembic("-x", f"config={cfg}", "upgrade", "head", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert _revision(f"sqlite:///{state / 'hotswap.db'}") == _head()
    assert not (tmp_path / "state").exists()


def test_alembic_upgrade_head_with_an_explicit_url(db_url: str, tmp_path: Path) -> None:
    out = _alembic("-x", f"url={db_url}", "upgrade", "head", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert _revision(db_url) == _head()


def test_existing_database_at_the_first_revision_runs_forward(db_url: str) -> None:
    from alembic import command

    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0001_initial")
    finally:
        engine.dispose()
    assert _revision(db_url) == "0001_initial"
    reg = Registry(db_url)
    try:
        reg.upgrade()
        assert reg.current_revision() == _head()
        assert {"version_history", "worker_versions"} <= set(inspect(reg.engine).get_view_names())
    finally:
        reg.close()


def test_version_flag_prints_the_installed_version(tmp_path: Path) -> None:
    out = hotswap_cli("--version", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"hotswap {daemon.__version__}"
    assert metadata.version("hotswap") == daemon.__version__
    assert not (tmp_path / "state").exists()


def test_license_file_matches_the_declared_license() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text()


def test_readme_links_only_files_that_exist() -> None:
    import re

    readme = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" in target:
            continue
        assert (REPO / target).exists(), f"README links {target}, which is not in the repository"
    assert "DESIGN.md" not in readme
