"""`[api]`: how the daemon's HTTP API may be reached from off this host (its address is `[daemon] listen`).

```toml
[daemon]
listen = "10.0.0.5:8780"        # not loopback: needs TLS, or allow_insecure_remote = true

[api]
tls_certfile = "/etc/hotswap/api.crt"   # PEM; with tls_keyfile the API is HTTPS only
tls_keyfile = "/etc/hotswap/api.key"
allow_insecure_remote = false   # true: serve plain HTTP on a non-loopback address anyway
allowed_hosts = ["hotswap-01.internal"]  # Host names control requests may carry besides loopback

[[api.tokens]]                  # named tokens with roles (daemon.common.tokens); control.token is admin
name = "alice"
role = "operator"
token_file = "/etc/hotswap/alice.token"
```

A non-loopback listen address without TLS is refused at start (`listen_problem`): the control
token would cross the network in clear text. The CLI trusts exactly `tls_certfile` (it is the
daemon's own certificate: no CA, no host name to match) when it talks to an HTTPS daemon.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from daemon.common.tokens import TokenSpec, check_token_names
from daemon.common.typedtoml import ConfigError

if TYPE_CHECKING:  # imported when a client needs it: reading a config never does
    import ssl


@dataclass
class ApiSettings:
    tls_certfile: str = ""  # PEM certificate (chain); "" = plain HTTP
    tls_keyfile: str = ""  # PEM private key of tls_certfile
    allow_insecure_remote: bool = False  # plain HTTP on a non-loopback [daemon] listen
    allowed_hosts: list[str] = field(default_factory=list)  # Host header names accepted besides loopback
    tokens: list[TokenSpec] = field(default_factory=list)  # [[api.tokens]]: named tokens with roles

    @property
    def tls(self) -> bool:
        return bool(self.tls_certfile)

    def validate(self, key: str) -> None:
        if bool(self.tls_certfile) != bool(self.tls_keyfile):
            raise ValueError(f"{key}: tls_certfile and tls_keyfile go together")
        for name in ("tls_certfile", "tls_keyfile"):
            path = getattr(self, name)
            if path and not os.access(os.path.expanduser(path), os.R_OK):
                raise ValueError(f"{key}.{name}: {path} is not a readable file")
        for i, host in enumerate(self.allowed_hosts):
            if not host or any(c in host for c in " /:@"):
                raise ValueError(f"{key}.allowed_hosts[{i}]: {host!r} is not a host name (no port, no scheme)")
        check_token_names(self.tokens, f"{key}.tokens")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and "localhost"; a wildcard (0.0.0.0, ::) or any other name is not."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def listen_problem(listen: tuple[str, int] | None, api: ApiSettings) -> str | None:
    """Why the daemon must not start with this listen address, or None."""
    if listen is None or is_loopback(listen[0]) or api.tls or api.allow_insecure_remote:
        return None
    return (
        f"daemon.listen: {listen[0]}:{listen[1]} is not a loopback address and [api] has no TLS: "
        "set [api] tls_certfile and tls_keyfile, or allow_insecure_remote = true to send the "
        "control token in clear text"
    )


def client_tls(api: ApiSettings, url: str) -> ssl.SSLContext | bool:
    """httpx `verify=` for a local client of the daemon's API: for an HTTPS daemon, trust exactly
    its own certificate (`tls_certfile`) and nothing else; plain HTTP: the default (True)."""
    if not url.startswith("https:") or not api.tls_certfile:
        return True
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # no system CAs: only the file below is trusted
    ctx.load_verify_locations(cafile=str(Path(api.tls_certfile).expanduser()))
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the daemon's own leaf is the trust anchor
    ctx.check_hostname = False  # pinned to that certificate: whatever name the client dialled
    return ctx


def parse_listen(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: {value!r} is not host:port (e.g. 127.0.0.1:8780)")
    return host.strip("[]"), int(port)
