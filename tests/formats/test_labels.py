"""Version labels a command could misread, and restart commands that run a shell (issue 37, item 6).

A label was substituted into `restart_command` arguments ({version}); with a shell wrapper
(`sh -c "systemctl restart vllm@{version}"`) a checkpoint's name became shell code, and the push
listener took the version `-rf`. Now a label is `[A-Za-z0-9._@+-]`, not starting with '-' or '.',
wherever one comes in (the folder, S3 and push sources have their own tests beside their other
name attacks; here: the rule, `hotswap publish` and the config), and a restart command whose first
word is a shell, directly or through `env`, is refused when the config is loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import free_port, hotswap_cli, make_config_file

from daemon.formats.names import version_problem
from daemon.tinymodel import make_tiny_checkpoint


@pytest.mark.parametrize("label", ["v1", "run-1@step-200", "v2+cu124", "a_b.c", "tiny-seed"])
def test_ordinary_labels_pass(label: str) -> None:
    assert version_problem(label) is None


@pytest.mark.parametrize(("label", "words"), [
    ("-rf", "starts with '-'"),
    ("$(id)", "a label is letters"),
    ("v1;reboot", "a label is letters"),
    ("v 1", "a label is letters"),
    ("v`id`", "a label is letters"),
    ("v1&&x", "a label is letters"),
    ("vé", "a label is letters"),
])  # fmt: skip
def test_labels_a_shell_or_a_command_would_read_are_refused(label: str, words: str) -> None:
    problem = version_problem(label)
    assert problem is not None and words in problem and "\n" not in problem, problem


def test_publish_refuses_such_a_label_before_writing_anything(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "ckpt", seed=1)
    done = hotswap_cli("publish", str(tmp_path / "ckpt"), "--version", "v$(reboot)")
    assert done.returncode != 0
    assert "a label is letters" in done.stderr, done.stderr
    assert not (tmp_path / "ckpt" / "hotswap-manifest.json").exists()
    done = hotswap_cli("publish", str(tmp_path / "ckpt"), "--version=-rf")
    assert done.returncode != 0 and "starts with '-'" in done.stderr + done.stdout, done.stderr


@pytest.mark.parametrize("command", [
    'sh -c "systemctl restart vllm@{version}"',
    ["/bin/bash", "-c", "systemctl restart vllm@{version}"],
    "/usr/bin/env bash -c 'x {version}'",
    ["env", "-i", "PATH=/bin", "dash", "-c", "x"],
    "zsh -c x",
])  # fmt: skip
def test_a_restart_command_that_runs_a_shell_is_refused_at_load(tmp_path: Path, command: object) -> None:
    cfg = make_config_file(tmp_path / "config.toml", daemon={"state_dir": str(tmp_path / "state")},
                           workers=[{"name": "w0", "url": "http://127.0.0.1:9", "restart_command": command}])  # fmt: skip
    done = hotswap_cli("config", "check", str(cfg))
    out = (done.stderr + done.stdout).strip()
    assert done.returncode != 0, out
    line = next(line for line in out.splitlines() if "restart_command" in line)
    assert "runs the shell" in line and "workers" in line, out


def test_a_restart_command_without_a_shell_is_accepted(tmp_path: Path) -> None:
    cfg = make_config_file(tmp_path / "config.toml",  # its own port: a daemon on 8780 would fail the check
                           daemon={"state_dir": str(tmp_path / "state"), "listen": f"127.0.0.1:{free_port()}"},
                           workers=[{"name": "w0", "url": "http://127.0.0.1:9",
                                     "restart_command": "systemctl restart vllm@{name}"}])  # fmt: skip
    done = hotswap_cli("config", "check", str(cfg))
    assert done.returncode == 0 and ": ok" in done.stdout, done.stderr + done.stdout
