"""`hotswap history` / `status` / `db current` tell the truth: they never create a database, fit
80 columns off a TTY without mid-word wraps (full values with --wide/--json), print user-controlled
names literally (rich markup, emoji codes, escape sequences), and `status` shows serving, last
good, pinned, each worker's state, version and URL, the queue and the daemon's health."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import hotswap_cli

from daemon.registry import Registry, status
from daemon.registry.journal import Journal
from daemon.registry.models import CheckpointStatus

C = CheckpointStatus
LONG = "run-2026-12-01-a-very-long-experiment-name-with-many-parts-step-123456"
REASON = "[red]boom[/red] compat: tensor model.layers.0.self_attn.q_proj.weight has shape [64, 64], serving has [32, 64]"
ESC = "esc\x1b[31mred"
VERSIONS = ["step-000100", "[/bold].txt", ":joy:", LONG, ESC, "bad-1"]


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return make_state(tmp_path)


def make_state(tmp_path: Path) -> Path:
    """A state folder whose database holds hostile names, aliases and a worker."""
    state = tmp_path / "state"
    state.mkdir()
    reg = Registry(f"sqlite:///{state / 'hotswap.db'}")
    reg.upgrade()
    ids: dict[str, int] = {}
    with reg.session() as s:
        for v in VERSIONS:
            ckpt = status.create(s, version=v, source="local:/ck", uri=f"file:///ck/{v}", local_path=f"/ck/{v}",
                                 commit_signal="manifest")  # fmt: skip
            assert ckpt is not None
            ckpt.total_bytes = 123_456_789
            status.move(s, ckpt, C.VERIFYING)
            if v == "bad-1":
                status.move(s, ckpt, C.REJECTED, REASON)
            else:
                status.move(s, ckpt, C.VERIFIED)
            ids[v] = ckpt.id
        for v in ("[/bold].txt", "step-000100"):
            c = s.get(type(ckpt), ids[v])
            assert c is not None
            status.move(s, c, C.DEPLOYED)
    j = Journal(reg)
    j.set_alias("serving", ids["step-000100"])
    j.set_alias("last_good", ids["[/bold].txt"])
    j.set_alias("pinned", ids[":joy:"])
    j.register_workers([("w0", "builtin", "http://127.0.0.1:8123", "cpu")])
    j.observe("w0", state="RUNNING", weight_version="step-000100", error=None)
    reg.close()
    return state


def _lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.strip()]


@pytest.mark.parametrize("columns", ["80", "60"])
def test_history_fits_the_terminal_without_mid_word_wraps(state: Path, columns: str) -> None:
    out = hotswap_cli("history", "--state-dir", str(state), env={"COLUMNS": columns})
    assert out.returncode == 0, out.stderr
    lines = _lines(out.stdout)
    assert all(len(ln) <= int(columns) for ln in lines), out.stdout
    assert "\x1b" not in out.stdout and "😂" not in out.stdout
    for v in ("step-000100", "[/bold].txt", ":joy:", "bad-1"):  # whole, literal, on one line each
        assert sum(v in ln for ln in lines) == 1, (v, out.stdout)
        line = next(ln for ln in lines if v in ln)
        assert ("rejected" if v == "bad-1" else "deployed" if v in ("step-000100", "[/bold].txt") else "verified") \
            in line, out.stdout  # the status column is never squeezed away
        if columns == "80":
            assert "123.5 MB" in line, out.stdout
    assert "esc\\x1b[31m" in out.stdout  # the escape sequence is shown, not sent
    long_line = next(ln for ln in lines if LONG[:10] in ln)
    assert LONG not in out.stdout and "…" in long_line  # abbreviated, never wrapped
    assert "left out to fit" in out.stdout and "--wide" in out.stdout


def test_history_wide_and_json_print_full_values(state: Path) -> None:
    wide = hotswap_cli("history", "--wide", "--state-dir", str(state), env={"COLUMNS": "80"})
    assert wide.returncode == 0, wide.stderr
    assert any(LONG in ln for ln in wide.stdout.splitlines())
    assert any(REASON in ln for ln in wide.stdout.splitlines())  # the markup-looking reason, literally
    assert "…" not in wide.stdout and "\x1b" not in wide.stdout
    js = hotswap_cli("history", "--json", "--state-dir", str(state))
    rows = [json.loads(ln) for ln in js.stdout.splitlines()]
    assert {r["version"] for r in rows} == set(VERSIONS)
    assert next(r for r in rows if r["version"] == "bad-1")["status_message"] == REASON


def test_status_shows_aliases_workers_and_queue(state: Path) -> None:
    out = hotswap_cli("status", "--state-dir", str(state), env={"COLUMNS": "80"})
    assert out.returncode == 3, out.stderr  # printed from the registry; exit 3: the daemon is not running
    lines = dict(ln.split(":", 1) for ln in _lines(out.stdout) if not ln.startswith("worker"))
    assert lines["daemon"].strip() == "not running"
    # the fixture's directories (/ck/...) do not exist: each alias says so, its path printed as is
    for alias, version in (("serving", "step-000100"), ("last_good", "[/bold].txt"), ("pinned", ":joy:")):
        assert lines[alias].strip() == f"{version}  (cannot be deployed here: its directory /ck/{version} is missing)"
    assert lines["queue"].strip().startswith("-")
    worker = next(ln for ln in out.stdout.splitlines() if ln.startswith("worker"))
    assert worker.split()[1:] == ["w0", "RUNNING", "step-000100", "http://127.0.0.1:8123"]
    doc = json.loads(hotswap_cli("status", "--json", "--state-dir", str(state)).stdout)
    assert doc["aliases"] == {"serving": "step-000100", "last_good": "[/bold].txt", "pinned": ":joy:"}


def test_status_names_a_version_on_trial_in_its_health_window() -> None:
    """While a health window is open `hotswap status` says whose and about how long is left: why
    last_good has not moved yet."""
    from daemon.cli.read import status_lines
    from daemon.config import Config

    doc: dict[str, Any] = {"daemon": {"running": True, "pid": 1, "api_url": "http://x", "queue_depth": 0,
                                      "window": {"version": "v3", "rollout_id": 7, "seconds": 30.0, "left_s": 12.5}}}  # fmt: skip
    assert "trial:       v3 in its health window, about 12.5 s of 30.0 s left (rollout 7)" in status_lines(doc, Config())
    doc["daemon"]["window"] = {"adapter": "sql", "version": "sql@2", "rollout_id": 8, "seconds": 30.0, "left_s": 1.0}
    assert any(line.startswith("trial:       adapter sql sql@2 in its health window") for line in status_lines(doc, Config()))
    doc["daemon"]["window"] = None
    assert not [line for line in status_lines(doc, Config()) if line.startswith("trial:")]


@pytest.mark.parametrize("command", [["history"], ["status"], ["history", "--json"], ["db", "current"]])
def test_read_only_commands_never_create_a_database(tmp_path: Path, command: list[str]) -> None:
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    out = hotswap_cli(*command, cwd=empty)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert str(empty / "state" / "hotswap.db") in lines[0] and "-c" in lines[0] and "--state-dir" in lines[0]
    assert list(empty.iterdir()) == []


def test_status_of_a_running_daemon_shows_health_and_queue(daemon_factory, tmp_path: Path) -> None:
    d = daemon_factory(f"sqlite:///{tmp_path / 'd.db'}")
    out = hotswap_cli("status", "-c", str(d.config_path))
    assert out.returncode == 0, out.stderr
    lines = dict(ln.split(":", 1) for ln in _lines(out.stdout) if ln.startswith(("daemon", "health", "queue")))
    assert lines["daemon"].strip().startswith(f"running (pid {d.pid}, {d.api_url}")
    assert lines["health"].strip() == "ok"
    assert lines["queue"].strip() == "0"


def test_verify_prints_a_markup_named_directory_literally(tmp_path: Path) -> None:
    from daemon.tinymodel import make_tiny_checkpoint

    ckpt = tmp_path / "x[/bold]:joy:[red]"
    make_tiny_checkpoint(ckpt, seed=1)
    out = hotswap_cli("verify", str(ckpt), "--skip", "forward", "--no-progress", env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and f"hotswap verify {ckpt}" in out.stdout and "😂" not in out.stdout
