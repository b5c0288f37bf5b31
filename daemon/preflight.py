"""What `hotswap daemon` checks before it touches anything: each problem is one line and exit 2.

`preflight(config)` runs before the database is migrated, a seed is made or a worker launched,
so a daemon that cannot work fails in a fraction of a second instead of after its start-up:

* the API port (`[daemon] listen`) is free: bound once here and released;
* every file the daemon will read a secret from exists and is usable: an external worker's
  `token_file`, the loader's `token_file` (transport "ipc"), and the manifest check keys
  (`[checks] hmac_keys` / `ed25519_keys`, parsed as the signature check would);
* sources that must exist at start (`[[sources]] required = true`) do.

Problems found while running (a watched folder removed later) are health problems instead:
`Daemon.health_problems()`, shown by `/health` (503) and `hotswap status`.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from pathlib import Path

from daemon.auth import TokenFileError, read_token_file
from daemon.checks.signatures import SignatureError, read_ed25519_public, read_hmac_key
from daemon.config import Config, ConfigError


def preflight(config: Config) -> None:
    """Raise `ConfigError` (one line naming the file or port) for the first problem found."""
    where = config.source_file
    check_port(config, where)
    for spec in config.workers:
        if spec.launch == "external" and spec.token_file:
            _token(Path(spec.token_file).expanduser(), f"{where}: [[workers]] {spec.name}: token_file")
    if config.loader is not None and config.loader.token_file and config.rollout.transport == "ipc":
        _token(Path(config.loader.token_file).expanduser(), f"{where}: [loader].token_file")
    for key_id, path in config.checks.hmac_keys.items():
        _key(read_hmac_key, Path(path).expanduser(), f"{where}: [checks].hmac_keys.{key_id}")
    for key_id, path in config.checks.ed25519_keys.items():
        _key(read_ed25519_public, Path(path).expanduser(), f"{where}: [checks].ed25519_keys.{key_id}")
    for i, source in enumerate(config.sources):
        check = getattr(source, "preflight_problem", None)
        problem = check() if callable(check) else None
        if problem:
            raise ConfigError(f"{where}: [sources][{i}]: {problem}")


def check_port(config: Config, where: str) -> None:
    listen = config.daemon.listen_host_port
    if listen is None or listen[1] == 0:
        return
    host, port = listen
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the API server binds it
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(port_error(where, config.daemon.listen, exc)) from None
    finally:
        sock.close()


def port_error(where: str, listen: str, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"{where}: [daemon].listen: {listen} is already in use (another hotswap daemon? "
                "choose another port or stop it)")  # fmt: skip
    return f"{where}: [daemon].listen: cannot listen on {listen}: {exc.strerror or exc}"


def _token(path: Path, key: str) -> None:
    try:
        read_token_file(path)
    except TokenFileError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _key(read: Callable[[Path], object], path: Path, key: str) -> None:
    try:
        read(path)
    except SignatureError as exc:
        raise ConfigError(f"{key}: {exc}") from None
