"""What a new user meets in their first hour, each through the real `hotswap` command: `hotswap
daemon --listen/--state-dir` without a config file's help, the daemon saying when it only verifies
(at start and in `hotswap status`), a rejection reason read whole (`hotswap show`), help text on
every option, and `--state-dir` on the commands that talk to the running daemon."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import REPO, hotswap_cli, make_config_file, publish_tiny, wait_until
from support_wait import free_port

from daemon.cli.main import _parser
from daemon.cli.publish import publish_parser


class Daemon:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "elsewhere" / "state"
        self.watch = root / "ckpts"
        self.config = make_config_file(root / "verify-only.toml", sources=[{"path": str(self.watch)}])
        self.port = free_port()
        self.log_path = root / "daemon.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env.pop("HOTSWAP_CONFIG", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.cli.main", "daemon", "-c", str(self.config),
                 "--listen", f"127.0.0.1:{self.port}", "--state-dir", str(self.state), "--log-level", "info"],
                cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("first-hour"))

    def up() -> bool:
        assert d.proc.poll() is None, d.log()
        return httpx.get(f"http://127.0.0.1:{d.port}/livez", timeout=2).status_code == 200

    wait_until(up, 60, 0.1, "the daemon's API on the --listen port")
    yield d
    d.stop()


def test_listen_and_state_dir_options_replace_the_config_keys(daemon: Daemon) -> None:
    runtime = json.loads((daemon.state / "daemon.json").read_text())
    assert runtime["api_url"] == f"http://127.0.0.1:{daemon.port}"
    assert (daemon.state / "hotswap.db").is_file() and not (daemon.root / "state").exists()


def test_a_config_without_workers_says_it_only_verifies_at_start_and_in_status(daemon: Daemon) -> None:
    wait_until(lambda: "verify only" in daemon.log(), 20, 0.1, "the verify-only warning")
    assert "no [[workers]]" in daemon.log()
    out = hotswap_cli("status", "-c", str(daemon.config), "--state-dir", str(daemon.state))
    assert out.returncode == 0, out.stderr
    mode = [line for line in out.stdout.splitlines() if line.startswith("mode:")]
    assert mode and "verify only" in mode[0] and str(daemon.config) in mode[0], out.stdout


def test_show_prints_a_rejection_reason_whole_and_every_check(daemon: Daemon, tmp_path: Path) -> None:
    ck = tmp_path / "broken-version-with-a-long-name"
    publish_tiny(ck, seed=3, version="broken-version-with-a-long-name")
    weights = next(ck.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # the manifest's CRC32C no longer matches
    weights.write_bytes(bytes(data))
    import shutil

    shutil.copytree(ck, daemon.watch / ck.name)
    args = ("-c", str(daemon.config), "--state-dir", str(daemon.state))

    def rejected() -> dict[str, object] | None:
        out = hotswap_cli("show", ck.name, "--json", *args)
        doc = json.loads(out.stdout) if out.returncode == 0 else None
        return doc if doc and doc["record"]["status"] == "rejected" else None

    doc = wait_until(rejected, 60, 0.3, "the corrupt checkpoint to be rejected")
    reason = str(doc["record"]["status_message"])  # type: ignore[index]
    assert "crc32c" in reason and len(reason) > 60
    env = {"COLUMNS": "60"}
    history = hotswap_cli("history", *args, env=env)
    assert reason not in history.stdout  # cut to fit 60 columns ...
    assert "hotswap show VERSION" in " ".join(history.stdout.split())  # ... and it says where to read it whole
    out = hotswap_cli("show", ck.name, *args, env=env)
    assert out.returncode == 0, out.stderr
    assert all(len(line) <= 60 for line in out.stdout.splitlines()), out.stdout
    reason_lines = out.stdout.split("reason:", 1)[1].split("\n")
    whole = " ".join(line.strip() for line in reason_lines[: 1 + next(i for i, line in enumerate(reason_lines[1:])
                                                                      if not line.startswith(" " * 16))])  # fmt: skip
    assert " ".join(reason.split()) == " ".join(whole.split())
    assert "  crc32c: fail" in out.stdout and "  manifest: pass" in out.stdout
    missing = hotswap_cli("show", "no-such-version", *args)
    assert missing.returncode == 1 and "no version no-such-version" in missing.stdout


def test_a_bad_listen_option_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = hotswap_cli("daemon", "--listen", "nowhere", "--state-dir", str(tmp_path / "s"), cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "daemon.listen" in out.stderr and "nowhere" in out.stderr


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                out[name] = sp
                out.update({f"{name} {k}": v for k, v in _subparsers(sp).items()})
    return out


def test_every_option_of_the_main_and_publish_parsers_has_help() -> None:
    parsers = {"publish": publish_parser(), **_subparsers(_parser())}
    missing = [f"{name}: {a.option_strings or a.dest}" for name, p in parsers.items() if p.add_help
               for a in p._actions if not isinstance(a, argparse._SubParsersAction) and not a.help]  # fmt: skip
    assert missing == []


def options_without_help(text: str) -> list[str]:
    """Option and argument lines of an argparse --help that carry no help text."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (-\S.*?|[A-Z{][^ ]*)(\s{2,}(\S.*))?$", line)
        if m and not m.group(3):
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if not re.match(r"^\s{8,}\S", following) or re.match(r"^  -", following):
                out.append(m.group(1))
    return out


@pytest.mark.parametrize("command", ["daemon", "publish", "push", "verify", "history", "status", "show",
                                     "config check", "db upgrade", "rollback", "pin", "unpin", "reverify",
                                     "fleet", "fleet target", "loader", "worker"])  # fmt: skip
def test_every_option_in_help_output_has_help_text(command: str) -> None:
    out = hotswap_cli(*command.split(), "--help")
    assert out.returncode == 0 and out.stdout.startswith(f"usage: hotswap {command}"), out.stdout[:200]
    assert options_without_help(out.stdout) == []


def test_publish_help_starts_with_its_usage_line() -> None:
    out = hotswap_cli("publish", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: hotswap publish")
    assert "upload (after writing the manifest):" in out.stdout and "--to s3://" in out.stdout


@pytest.mark.parametrize("command", ["rollback", "pin", "unpin", "reverify"])
def test_control_commands_take_state_dir(command: str, tmp_path: Path) -> None:
    assert "--state-dir" in hotswap_cli(command, "--help").stdout
    argv = [command, *(["v1"] if command in ("pin", "reverify") else []), "--state-dir", str(tmp_path / "st")]
    out = hotswap_cli(*argv, cwd=tmp_path)
    if command == "reverify":  # offline: queued in that state dir's database
        assert (tmp_path / "st").exists() or out.returncode != 0
    else:  # looked for the running daemon in that state dir
        assert out.returncode == 1 and str(tmp_path / "st" / "daemon.json") in out.stderr, out.stderr
