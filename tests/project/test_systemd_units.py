"""systemd/: the units, the config template, the polkit rule and check-units.sh agree.

Every path the daemon's code or config uses is read from the files themselves, so a unit
edited without its config (or the other way round) fails here. `systemd-analyze verify` and
`security` on the real units run in .ci/run (scripts/check-units.sh); here it only runs to
show that it fails on a broken or weakened unit.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
from conftest import REPO

from daemon.config import load_config

pytestmark = pytest.mark.quick

UNITS = REPO / "systemd"
CHECK_UNITS = REPO / "scripts" / "check-units.sh"
VENV_BIN = "/opt/hotswap/venv/bin/hotswap"


def parse_unit(path: Path, instance: str | None = None) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value in order (keys like DeviceAllow= repeat); %i filled in."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        if instance is not None:
            value = value.replace("%i", instance)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section][key]
    assert len(values) == 1, f"{key}= set {len(values)} times"
    return values[0]


def exec_argv(unit: dict[str, dict[str, list[str]]]) -> list[str]:
    return shlex.split(one(unit, "Service", "ExecStart"))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def daemon_unit():
    return parse_unit(UNITS / "hotswap.service")


@pytest.fixture(scope="module")
def loader_unit():
    return parse_unit(UNITS / "hotswap-loader.service")


@pytest.fixture(scope="module")
def worker0_unit():
    return parse_unit(UNITS / "hotswap-worker@.service", instance="0")


@pytest.fixture(scope="module")
def config():
    return load_config(UNITS / "config.toml")


# --------------------------------------------------------------------------- paths agree


def test_every_service_runs_the_wheel_venv_as_hotswap(daemon_unit, loader_unit, worker0_unit):
    sysusers = (UNITS / "sysusers.d" / "hotswap.conf").read_text()
    assert re.search(r"^u\s+hotswap\s", sysusers, re.M)
    for unit in (daemon_unit, loader_unit, worker0_unit):
        assert exec_argv(unit)[0] == VENV_BIN
        assert one(unit, "Service", "User") == "hotswap"
        assert one(unit, "Service", "Group") == "hotswap"


def test_daemon_state_dir_is_its_state_directory_and_the_users_home(daemon_unit, config):
    assert exec_argv(daemon_unit)[1:] == ["daemon", "-c", "/etc/hotswap/config.toml"]
    state = "/var/lib/" + one(daemon_unit, "Service", "StateDirectory")
    assert str(config.state_dir) == state
    assert one(daemon_unit, "Service", "WorkingDirectory") == state
    sysusers = (UNITS / "sysusers.d" / "hotswap.conf").read_text()
    assert re.search(rf"^u\s+hotswap\s.*\s{re.escape(state)}\s*$", sysusers, re.M)
    # the modes the daemon sets itself (daemon.common.private): systemd makes the directory the same
    # way, and the umask keeps everything else the daemon's own
    assert one(daemon_unit, "Service", "StateDirectoryMode") == "0700"
    assert one(daemon_unit, "Service", "UMask") == "0077"


def test_loader_socket_is_the_configs_and_lives_in_the_shared_runtime_directory(
    daemon_unit, loader_unit, config
):
    socket = flag(exec_argv(loader_unit), "--socket")
    assert config.loader is not None and config.loader.socket == socket
    runtime = one(loader_unit, "Service", "RuntimeDirectory")
    assert PurePosixPath(socket).parent == PurePosixPath("/run") / runtime
    # Both units declare it and keep it on stop: one's stop never deletes the other's socket.
    assert one(daemon_unit, "Service", "RuntimeDirectory") == runtime
    for unit in (daemon_unit, loader_unit):
        assert one(unit, "Service", "RuntimeDirectoryPreserve") == "yes"
    assert "hotswap.service" in one(loader_unit, "Unit", "Before").split()


def test_worker_tokens_reach_daemon_and_worker_from_one_file(daemon_unit, worker0_unit, config):
    # Daemon: every file of a root-only directory, as <ID>_<file name>.
    cred_id, _, cred_dir = one(daemon_unit, "Service", "LoadCredential").partition(":")
    assert cred_dir == "/etc/hotswap/credentials"
    # Worker instance 0: its own file only, under its own credential name.
    worker_cred, _, worker_src = one(worker0_unit, "Service", "LoadCredential").partition(":")
    assert worker_src == f"{cred_dir}/worker-0.token"
    assert flag(exec_argv(worker0_unit), "--token-file") == "${CREDENTIALS_DIRECTORY}/" + worker_cred
    spec = next(w for w in config.workers if w.name == "worker-0")
    assert spec.token_file == f"/run/credentials/hotswap.service/{cred_id}_worker-0.token"
    tmpfiles = (UNITS / "tmpfiles.d" / "hotswap.conf").read_text()
    assert re.search(rf"^d\s+{re.escape(cred_dir)}\s+0700\s+root\s+root\s", tmpfiles, re.M)


def test_worker_env_template_fills_every_variable_and_matches_the_config(worker0_unit, config):
    env: dict[str, str] = {}
    for line in (UNITS / "worker.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            assert "#" not in value, f"{key}: systemd keeps a trailing comment as part of the value"
            env[key] = value
    assert one(worker0_unit, "Service", "EnvironmentFile") == "/etc/hotswap/worker-0.env"
    used = set(re.findall(r"\$\{(\w+)\}", one(worker0_unit, "Service", "ExecStart")))
    assert used - {"CREDENTIALS_DIRECTORY"} <= set(env)
    spec = next(w for w in config.workers if w.name == "worker-0")
    assert spec.url == f"http://127.0.0.1:{env['PORT']}"
    assert spec.device == env["DEVICE"]


def test_workers_belong_to_the_shipped_target(worker0_unit):
    assert (UNITS / "hotswap-workers.target").is_file()
    assert one(worker0_unit, "Unit", "PartOf") == "hotswap-workers.target"
    assert one(worker0_unit, "Install", "WantedBy") == "hotswap-workers.target"


def test_daemon_is_notify_with_watchdog_and_config_errors_are_not_restarted(daemon_unit):
    assert one(daemon_unit, "Service", "Type") == "notify"
    assert one(daemon_unit, "Service", "NotifyAccess") == "main"
    assert int(one(daemon_unit, "Service", "WatchdogSec")) > 0
    assert one(daemon_unit, "Service", "RestartPreventExitStatus") == "2"  # cli.EXIT_CONFIG


def test_gpu_units_allow_nvidia_devices_only(daemon_unit, loader_unit, worker0_unit):
    for unit in (daemon_unit, loader_unit, worker0_unit):
        s = unit["Service"]
        assert s["DevicePolicy"] == ["closed"]
        assert s["DeviceAllow"] == ["char-nvidia* rw"]
        assert s["CapabilityBoundingSet"] == [""]
        assert s["NoNewPrivileges"] == ["yes"]
        assert s["UMask"] == ["0077"]
        assert s["RemoveIPC"] == ["no"]  # shm segments are shared between the three units
        assert "PrivatePIDs" not in s  # CUDA IPC checks the exporter's pid


# --------------------------------------------------------------------------- polkit rule

POLKIT_HARNESS = r"""
// node -e SCRIPT -- RULE CASES: process.argv is [node, RULE, CASES]
const fs = require("fs"), vm = require("vm");
let rule = null;
const polkit = {Result: {YES: "yes", NO: "no", AUTH_ADMIN: "auth_admin", NOT_HANDLED: null},
                addRule: (f) => { rule = f; }};
vm.runInNewContext(fs.readFileSync(process.argv[1], "utf8"), {polkit});
const cases = JSON.parse(process.argv[2]);
console.log(JSON.stringify(cases.map(([id, user, details]) =>
    rule({id, lookup: (k) => details[k]}, {user}))));
"""


def run_polkit_rule(cases: list[tuple[str, str, dict[str, str]]]) -> list[str | None]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node not installed: cannot evaluate the polkit rule")
    out = subprocess.run(
        [
            node,
            "-e",
            POLKIT_HARNESS,
            "--",
            str(UNITS / "polkit" / "50-hotswap-workers.rules"),
            json.dumps(cases),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


MANAGE = "org.freedesktop.systemd1.manage-units"


def test_polkit_rule_allows_the_configured_restart_command(config):
    cases = []
    for spec in config.workers:
        argv = spec.restart_argv()
        assert argv[:2] == ["systemctl", "--no-ask-password"]
        cases.append((MANAGE, "hotswap", {"unit": argv[3], "verb": argv[2]}))
    assert run_polkit_rule(cases) == ["yes"] * len(cases)


def test_polkit_rule_allows_only_start_stop_restart_of_workers_to_hotswap():
    allowed = [
        (MANAGE, "hotswap", {"unit": f"hotswap-worker@{i}.service", "verb": v})
        for i in ("0", "7", "gpu-1")
        for v in ("start", "stop", "restart")
    ]
    refused = [
        (MANAGE, "nobody", {"unit": "hotswap-worker@0.service", "verb": "restart"}),
        (MANAGE, "hotswap", {"unit": "hotswap.service", "verb": "restart"}),
        (MANAGE, "hotswap", {"unit": "hotswap-loader.service", "verb": "stop"}),
        (MANAGE, "hotswap", {"unit": "sshd.service", "verb": "stop"}),
        (MANAGE, "hotswap", {"unit": "hotswap-worker@.service", "verb": "start"}),
        (MANAGE, "hotswap", {"unit": "hotswap-worker@0.service.d", "verb": "start"}),
        (MANAGE, "hotswap", {"unit": "xhotswap-worker@0.service", "verb": "start"}),
        (MANAGE, "hotswap", {"unit": "hotswap-worker@0/../x.service", "verb": "start"}),
        (MANAGE, "hotswap", {"unit": "hotswap-worker@0.service", "verb": "reload"}),
        (MANAGE, "hotswap", {"unit": "hotswap-worker@0.service", "verb": "kill"}),
        (MANAGE, "hotswap", {"verb": "restart"}),
        ("org.freedesktop.systemd1.manage-unit-files", "hotswap", {}),
        ("org.freedesktop.systemd1.set-environment", "hotswap", {}),
        ("org.freedesktop.login1.reboot", "hotswap", {}),
    ]
    assert run_polkit_rule(allowed) == ["yes"] * len(allowed)
    assert run_polkit_rule(refused) == [None] * len(refused)


# --------------------------------------------------------------------------- check-units.sh can fail


def _check_units_on(tmp_path: Path, edit: dict[str, tuple[str, str]]) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    copy = tmp_path / "systemd"
    shutil.copytree(UNITS, copy)
    for name, (old, new) in edit.items():
        text = (copy / name).read_text()
        assert old in text
        (copy / name).write_text(text.replace(old, new))
    return subprocess.run(
        ["bash", str(CHECK_UNITS)],
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "UNITS_DIR": str(copy)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_units_fails_on_an_unknown_key(tmp_path):
    out = _check_units_on(
        tmp_path, {"hotswap-worker@.service": ("KillMode=mixed", "KillMode=mixed\nProtectSystm=strict")}
    )
    assert out.returncode == 1
    assert "systemd-analyze verify hotswap-worker@0.service" in out.stderr
    assert "Unknown key 'ProtectSystm'" in out.stderr


def test_check_units_fails_on_a_weakened_unit_naming_it(tmp_path):
    text = (UNITS / "hotswap-loader.service").read_text()
    sandbox = text[text.index("UMask=0077") : text.index("[Install]")]
    out = _check_units_on(tmp_path, {"hotswap-loader.service": (sandbox, "")})
    assert out.returncode == 1
    assert re.search(r"hotswap-loader\.service: exposure \d+\.\d > 4\.5", out.stderr), out.stderr
