"""What `hotswap daemon` checks before it touches anything: each problem is one line and exit 2.

`run_preflight(config)` runs before the database is migrated, a seed is made or a worker launched,
so a daemon that cannot work fails in a fraction of a second instead of after its start-up:

* the API port (`[daemon] listen`) is free: bound once here and released;
* every file the daemon will read a secret from exists and is usable: an external worker's
  `token_file` and `admin_token_file`, the loader's `token_file` (transport "ipc"), every
  `*_file` key of a `[[sources]]` table (push: token, TLS certificate/key/CA), each `[[api.tokens]]`
  token file and `[[webhooks]]` secret file (private to this user, as control.token), and the manifest
  check keys (`[checks] hmac_keys` / `ed25519_keys`, parsed as the signature check would);
* sources that must exist at start (`[[sources]] required = true`) do.

Problems found while running (a watched folder removed later) are health problems instead:
`Daemon.health_problems()`, shown by `/health` (503) and `hotswap status`.
"""

from __future__ import annotations

import dataclasses
import errno
import socket
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from daemon.checks import SignatureError, read_ed25519_public, read_hmac_key
from daemon.common import TokenFileError, parse_listen, read_private_token_file, read_token_file
from daemon.config import Config, ConfigError


def run_preflight(config: Config) -> None:
    """Raise `ConfigError` (one line naming the file or port) for the first problem found."""
    problems = preflight_problems(config)
    if problems:
        raise ConfigError(problems[0])


def preflight_problems(config: Config) -> list[str]:
    """Every problem the start would hit, one line each, in the order `run_preflight` looks
    (`hotswap config check` prints them all)."""
    out: list[str] = []
    for check in _checks(config):
        try:
            check()
        except ConfigError as exc:
            out.append(str(exc))
    return out


def _checks(config: Config) -> Iterator[Callable[[], None]]:
    where = config.source_file
    yield lambda: check_port(config, where)
    for spec in config.workers:
        if spec.launch == "external" and spec.token_file:
            yield partial(_token, Path(spec.token_file).expanduser(), f"{where}: [[workers]] {spec.name}: token_file")
        if spec.admin_token_file:
            yield partial(_token, Path(spec.admin_token_file).expanduser(),
                          f"{where}: [[workers]] {spec.name}: admin_token_file")  # fmt: skip
    if config.loader is not None and config.loader.token_file and config.rollout.transport == "ipc":
        yield partial(_token, Path(config.loader.token_file).expanduser(), f"{where}: [loader].token_file")
    for key_id, path in config.checks.hmac_keys.items():
        yield partial(_key, read_hmac_key, Path(path).expanduser(), f"{where}: [checks].hmac_keys.{key_id}")
    for key_id, path in config.checks.ed25519_keys.items():
        yield partial(_key, read_ed25519_public, Path(path).expanduser(), f"{where}: [checks].ed25519_keys.{key_id}")
    for i, source in enumerate(config.sources):
        yield from _source_files(source, f"{where}: [sources][{i}]")
        yield partial(_source_problem, source, f"{where}: [sources][{i}]")
    for i, tok in enumerate(config.api.tokens):  # named tokens and webhook secrets: private, like control.token
        yield partial(_private, Path(tok.token_file).expanduser(), f"{where}: api.tokens[{i}].token_file ({tok.name})")
    for i, hook in enumerate(config.webhooks):
        if hook.secret_file:
            yield partial(_private, Path(hook.secret_file).expanduser(), f"{where}: webhooks[{i}].secret_file ({hook.name})")


def _source_problem(source: object, key: str) -> None:
    check = getattr(source, "preflight_problem", None)
    problem = check() if callable(check) else None
    if problem:
        raise ConfigError(f"{key}: {problem}")


def check_port(config: Config, where: str) -> None:
    listen = config.daemon.listen_host_port
    if listen is not None:
        _bind(listen, f"{where}: [daemon].listen", config.daemon.listen)


def _bind(host_port: tuple[str, int], key: str, listen: str) -> None:
    host, port = host_port
    if port == 0:
        return
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind it
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(_port_message(key, listen, exc)) from None
    finally:
        sock.close()


def port_error(where: str, listen: str, exc: OSError) -> str:
    return _port_message(f"{where}: [daemon].listen", listen, exc)


def _port_message(key: str, listen: str, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"{key}: {listen} is already in use (another hotswap daemon? choose another port or stop it)"
    return f"{key}: cannot listen on {listen}: {exc.strerror or exc}"


def _source_files(source: object, key: str) -> Iterator[Callable[[], None]]:
    """Every `*_file` key of a source's table (push: token_file, tls_cert_file, ...): a token file
    must hold a token, any other file must be a readable file."""
    if not dataclasses.is_dataclass(source):
        return
    for f in dataclasses.fields(source):
        value = getattr(source, f.name)
        if f.name in ("hmac_keys", "ed25519_keys") and isinstance(value, dict):
            read = read_hmac_key if f.name == "hmac_keys" else read_ed25519_public
            for key_id, key_path in value.items():
                yield partial(_key, read, Path(key_path).expanduser(), f"{key}.{f.name}.{key_id}")
            continue
        if f.name == "listen" and isinstance(value, str) and value:
            yield partial(_listen, value, f"{key}.listen")
            continue
        if not f.name.endswith("_file") or not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        yield partial(_token if f.name.endswith("token_file") else _readable, path, f"{key}.{f.name}")


def _listen(value: str, key: str) -> None:
    _bind(parse_listen(value, key), key, value)


def _readable(path: Path, key: str) -> None:
    try:
        with path.open("rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise ConfigError(f"{key}: {path}: {exc.strerror or exc}") from None


def _token(path: Path, key: str) -> None:
    try:
        read_token_file(path)
    except TokenFileError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _private(path: Path, key: str) -> None:
    try:
        read_private_token_file(path)
    except TokenFileError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _key(read: Callable[[Path], object], path: Path, key: str) -> None:
    try:
        read(path)
    except SignatureError as exc:
        raise ConfigError(f"{key}: {exc}") from None
