"""Config loading: defaults, the documented example, and one clear error per kind of mistake."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
from conftest import REPO, hotswap_cli

from daemon.checks import CheckSettings
from daemon.config import (
    Config,
    ConfigError,
    load_config,
    parse_config,
)
from daemon.sources import SOURCE_TYPES, source_type

pytestmark = pytest.mark.quick

EXAMPLE = REPO / "config.example.toml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return p


def test_no_file_gives_the_embedded_default(monkeypatch):
    monkeypatch.delenv("HOTSWAP_CONFIG", raising=False)
    cfg = load_config(None)
    assert cfg.database_url == "sqlite:///state/hotswap.db"
    assert [s.path for s in cfg.sources] == ["./checkpoints"]
    assert cfg.sources[0].commit_signals == ["manifest", "index", "marker"]
    assert cfg.sources[0].quiet_period_s == 2.0
    assert cfg.daemon.listen_host_port == ("127.0.0.1", 8780)
    assert cfg.checks == CheckSettings()


def test_example_file_parses_to_the_defaults():
    example = load_config(EXAMPLE)
    default = parse_config({}, "x")
    example.source_file = default.source_file
    assert example == default


def test_example_file_documents_every_key():
    text = EXAMPLE.read_text()
    hints = typing.get_type_hints(Config)
    sections: dict[str, type] = {"checks": CheckSettings}
    # [[sources]] is a union on `type`: every registered source type's table must be documented
    sources = {f"sources (type {t!r})": source_type(t).config_type for t in SOURCE_TYPES}
    for name, tp in hints.items():
        tp = next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), tp)  # list[X], X | None
        if dataclasses.is_dataclass(tp):
            sections[name] = tp
    for name, cls in {**sections, **sources}.items():
        for f in dataclasses.fields(cls):
            assert re.search(rf"^#?\s*{f.name}\s*=", text, re.M), (
                f"config.example.toml lacks [{name}] {f.name}"
            )
    top = {f.name for f in dataclasses.fields(Config)} - {"source_file"}
    for name in top:
        assert re.search(rf"^#?\s*\[\[?{name}\]\]?", text, re.M), f"config.example.toml lacks section {name}"


def test_full_file_is_typed(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            """
[daemon]
state_dir = "/var/lib/hotswap"
listen = "[::1]:9000"
[database]
url = "postgresql+psycopg://u@h/db"
[[sources]]
path = "/a"
quiet_period_s = 1
commit_signals = ["marker"]
[[sources]]
path = "/b"
name = "trainer"
[checks]
enabled = ["manifest", "crc32c"]
headroom_factor = 2
hmac_keys = { "k1" = "/etc/k1" }
forward_prompts = [[1, 2], [3]]
""",
        )
    )
    assert cfg.daemon.listen_host_port == ("::1", 9000)
    assert cfg.database_url == "postgresql+psycopg://u@h/db"
    assert cfg.sources[0].quiet_period_s == 1.0 and isinstance(cfg.sources[0].quiet_period_s, float)
    assert [s.label for s in cfg.sources] == ["local:/a", "trainer"]
    assert cfg.checks.enabled == ("manifest", "crc32c")
    assert cfg.checks.headroom_factor == 2.0
    assert cfg.checks.hmac_keys == {"k1": Path("/etc/k1")}
    assert cfg.checks.forward_prompts == ((1, 2), (3,))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[daemon]\nlog_levle = 'info'\n", "daemon.log_levle: unknown key (known: keep_workers_on_stop, listen, log_level"),
        ("[deamon]\n", "unknown section or key 'deamon'"),
        ("[daemon]\nlisten = 8780\n", "daemon.listen: expected a string, got integer 8780"),
        ("[daemon]\nlisten = 'localhost'\n", "daemon.listen: 'localhost' is not host:port"),
        ("[daemon]\nlog_level = 'loud'\n", "daemon.log_level: 'loud' is not one of"),
        ("[[sources]]\nquiet_period_s = 1\n", "sources[0].path: missing required value"),
        (
            "[[sources]]\npath = 'x'\nquiet_period_s = 'long'\n",
            "sources[0].quiet_period_s: expected a number",
        ),
        (
            "[[sources]]\npath = 'x'\ncommit_signals = ['done']\n",
            "sources[0].commit_signals: 'done' is not one of",
        ),
        ("[[sources]]\npath = 'x'\ntype = 's4'\n", "sources[0].type: 's4' is not one of"),
        ("[[sources]]\npath = 'x'\ncreate = 'yes'\n", "sources[0].create: expected true or false"),
        ("[database]\nurl = 'hotswap.db'\n", "database.url: 'hotswap.db' is not a SQLAlchemy URL"),
        ("[checks]\nheadroom_factor = 'big'\n", "checks.headroom_factor: expected a number"),
        ("[checks]\nenabled = ['crc32', 'manifest']\n", "unknown check names ['crc32']"),
        ("[checks]\nhmac_keys = ['a']\n", "checks.hmac_keys: expected a table"),
        ("daemon = 3\n", "[daemon]: expected a table, got integer"),
        ("[daemon\n", "invalid TOML"),
        ("[rollout]\nhealth_window_s = nan\n", "rollout.health_window_s: expected a finite number, got nan"),
        ("[rollout]\ndrain_timeout_s = inf\n", "rollout.drain_timeout_s: expected a finite number, got inf"),
        ("[[sources]]\npath = 'x'\nquiet_period_s = -inf\n", "sources[0].quiet_period_s: expected a finite number"),
        ("[rollout]\nrejoin_s = -1\n", "rollout.rejoin_s: must be >= 0"),
    ],
)
def test_errors_name_the_file_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    line = str(err.value)
    assert line.startswith(f"{path}: ")
    assert message in line
    assert "\n" not in line


def test_missing_file_and_env_var(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    monkeypatch.setenv("HOTSWAP_CONFIG", str(write(tmp_path, "[daemon]\nlog_level = 'debug'\n")))
    assert load_config(None).daemon.log_level == "debug"


@pytest.mark.parametrize("command", [["daemon"], ["history"], ["status"], ["db", "upgrade"]])
def test_cli_bad_config_is_one_line_and_exit_2(tmp_path, command):
    path = write(tmp_path, "[[sources]]\npath = 3\n")
    out = hotswap_cli(*command, "-c", str(path), cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"hotswap: error: {path}: sources[0].path: expected a string, got integer 3"
    ]
    assert "Traceback" not in out.stdout + out.stderr


def test_ipc_transport_turns_on_the_gpu_headroom_check(tmp_path):
    from daemon.config import load_config

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[rollout]\ntransport = "ipc"\n')
    assert load_config(cfg_file).checks.ipc_enabled is True
    cfg_file.write_text('[rollout]\ntransport = "disk"\n')
    assert load_config(cfg_file).checks.ipc_enabled is False
