"""Leaves every layer may use: process-level building blocks that know nothing of checkpoints.

    logging     structlog setup (JSON under systemd, console on a terminal), `get_logger`
    metrics     the daemon's Prometheus metric objects
    auth        bearer tokens: token files, `ControlGuard`
    jsonbody    bounded JSON request bodies
    apiconfig   listener settings (address, TLS) and the client side of TLS
    tcplisten   TCP listening sockets (TCP_NODELAY, reuse rules)
    identity    per-launch worker secrets and the private socket folder
    statelock   one daemon per state directory (flock)
    private     the state directory's modes: folders 0700, files 0600, whatever the umask
    systemd     sd_notify: READY, STATUS, WATCHDOG
    backoff     doubling delays with a reset
    redact      secrets out of URLs and documents before they are shown

Architecture invariant: imports nothing of the daemon's outside this package (leaf layer).
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.common import redact, systemd
    from daemon.common.apiconfig import ApiSettings, client_tls, is_loopback, listen_problem, parse_listen
    from daemon.common.auth import (
        ControlGuard,
        TokenFileError,
        build_guard,
        control_token_path,
        read_private_token_file,
        read_token_file,
    )
    from daemon.common.backoff import Backoff, backoff_delay
    from daemon.common.cliconfig import CONFIG_ENV, LOG_LEVELS
    from daemon.common.commands import shell_of
    from daemon.common.httpguard import ListenerLimits, guarded_protocol
    from daemon.common.identity import (
        PrivateDirError,
        check_private_socket_dir,
        new_nonce,
        proof,
        proof_ok,
        socket_dir,
        valid_nonce,
        write_secret,
    )
    from daemon.common.jsonbody import JsonBodyError, json_object, parse_object, read_capped
    from daemon.common.logging import bind_version, configure_logging, get_logger
    from daemon.common.metrics import CONTENT_TYPE, DaemonMetrics
    from daemon.common.private import DIR_MODE, FILE_MODE, open_private, private_dir, tighten, write_private
    from daemon.common.problems import WARNING, Changes, Problem, ProblemBook
    from daemon.common.redact import redact_doc
    from daemon.common.statelock import StateDirLock, StateDirLocked
    from daemon.common.tcplisten import tcp_listener
    from daemon.common.tokens import Caller
    from daemon.common.typedtoml import ConfigError, build_dataclass, convert, type_name

__all__ = [
    "ApiSettings", "Backoff", "CONFIG_ENV", "CONTENT_TYPE", "Caller", "Changes", "ConfigError",
    "ControlGuard", "DIR_MODE", "DaemonMetrics", "FILE_MODE", "JsonBodyError", "LOG_LEVELS",
    "ListenerLimits", "PrivateDirError", "Problem", "ProblemBook", "StateDirLock", "StateDirLocked",
    "TokenFileError", "WARNING", "backoff_delay", "bind_version", "build_dataclass", "build_guard",
    "check_private_socket_dir", "client_tls", "configure_logging", "control_token_path", "convert",
    "get_logger", "guarded_protocol", "is_loopback", "json_object", "listen_problem", "new_nonce",
    "open_private", "parse_listen", "parse_object", "private_dir", "proof", "proof_ok", "read_capped",
    "read_private_token_file", "read_token_file", "redact", "redact_doc", "shell_of", "socket_dir",
    "systemd", "tcp_listener", "tighten", "type_name", "valid_nonce", "write_private", "write_secret"
]

__getattr__ = public_face(__name__)
