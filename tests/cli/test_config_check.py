"""`hotswap config check FILE`: a config validated without starting anything, one line per problem
(real files, a real port held by a real listener)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import REPO, hotswap_cli

from daemon.cli.main import main

pytestmark = pytest.mark.quick


def check(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, list[str]]:
    code = main(["config", "check", str(path)])
    return code, capsys.readouterr().out.splitlines()


def test_the_example_config_is_good(capsys, tmp_path) -> None:
    # its listen port may be taken on a busy machine: check a copy on port 0
    text = (REPO / "config.example.toml").read_text().replace('listen = "127.0.0.1:8780"', 'listen = "127.0.0.1:0"')
    (tmp_path / "ok.toml").write_text(text.replace('"./checkpoints"', f'"{tmp_path / "ck"}"'))
    code, lines = check(capsys, tmp_path / "ok.toml")
    assert code == 0 and lines == [f"{tmp_path / 'ok.toml'}: ok (1 source(s), no [[workers]]: the daemon only verifies)"]
    assert not (tmp_path / "ck").exists() and not (tmp_path / "state").exists()  # nothing created


def test_every_bad_section_is_one_line(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[daemon]\nlisten = "127.0.0.1:0"\nlog_lvl = "info"\n'
        '[rollout]\nmax_error_rate = "high"\n'
        '[[sources]]\npath = "a"\nquiet_period_s = "long"\n'
        '[[sources]]\npath = "b"\n'
        '[[sources]]\ntype = "ftp"\n'
        '[typo]\nx = 1\n'
    )
    code, lines = check(capsys, bad)
    assert code == 2
    assert all(line.startswith(f"hotswap: error: {bad}: ") for line in lines), lines
    text = "\n".join(lines)
    assert "daemon.log_lvl: unknown key" in text
    assert "rollout.max_error_rate: expected a number, got string 'high'" in text
    assert "sources[0].quiet_period_s: expected a number" in text
    assert "sources[2].type: 'ftp' is not one of" in text
    assert "'typo'" in text
    assert len(lines) == 5 and "sources[1]" not in text


def test_every_bad_key_of_one_section_is_its_own_line(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\nlisten = "nonsense"\nbogus = 1\nlog_level = 3\n[rollout]\nmode = "drian"\n')
    code, lines = check(capsys, bad)
    assert code == 2
    text = "\n".join(lines)
    assert "daemon.bogus: unknown key" in text and "daemon.log_level: expected" in text, lines
    assert "daemon.listen: 'nonsense' is not host:port" in text and "rollout.mode: 'drian'" in text, lines
    assert len(lines) == 4, lines


def test_missing_files_and_a_busy_port_are_each_named(capsys, tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cfg = tmp_path / "files.toml"
        cfg.write_text(
            f'[daemon]\nlisten = "127.0.0.1:{port}"\n'
            f'[checks]\nhmac_keys = {{ "trainer" = "{tmp_path}/no-such.key" }}\n'
            f'[[workers]]\nname = "w0"\nurl = "http://127.0.0.1:8001"\ntoken_file = "{tmp_path}/w0.token"\n'
            f'[[sources]]\npath = "{tmp_path}/mnt"\ncreate = false\nrequired = true\n'
        )
        code, lines = check(capsys, cfg)
    assert code == 2 and len(lines) == 4, lines
    assert f"[daemon].listen: 127.0.0.1:{port} is already in use" in lines[0]
    assert "[[workers]] w0: token_file: token file" in lines[1] and "does not exist" in lines[1]
    assert "[checks].hmac_keys.trainer" in lines[2]
    assert "[sources][0]" in lines[3] and "mnt" in lines[3]


def test_the_command_line_exit_codes(tmp_path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(f'[daemon]\nlisten = ""\nstate_dir = "{tmp_path}/s"\n')
    assert hotswap_cli("config", "check", str(good)).returncode == 0
    out = hotswap_cli("config", "check", str(tmp_path / "missing.toml"))
    assert out.returncode == 2 and "config file not found" in out.stdout
    (tmp_path / "broken.toml").write_text("[daemon\n")
    out = hotswap_cli("config", "check", str(tmp_path / "broken.toml"))
    assert out.returncode == 2 and "invalid TOML" in out.stdout and out.stdout.count("\n") == 1
