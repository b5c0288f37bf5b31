"""Named API tokens with roles (`[[api.tokens]]`): who may change what, and the name events record.

```toml
[[api.tokens]]
name = "alice"                            # recorded as `by` in every event this token causes
role = "operator"                         # viewer | operator | admin
token_file = "/etc/hotswap/alice.token"   # one line; owned by the daemon's user, mode 0600
```

Roles are ordered, each allowed what the one before it is: `viewer` reads (`/v1/whoami`; the GET
routes are open on loopback anyway); `operator` also pins, unpins, rolls back, reverifies and
pauses or resumes a fleet rollout; `admin` also sets the fleet target, aborts a fleet rollout
and opens broadcast sessions. The daemon's own `<state_dir>/control.token` is always there, as
the `admin` named `control-token`. Token files are read like the control token: a regular file
of this user, closed to group and others, or the daemon refuses to start (one line).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

ROLES = ("viewer", "operator", "admin")  # each allowed what the one before it is
CONTROL_TOKEN_NAME = "control-token"


@dataclass
class TokenSpec:
    name: str = ""  # who: recorded as `by` in events (letters, digits, . _ @ + -)
    role: str = "viewer"  # viewer | operator | admin
    token_file: str = ""  # the bearer token, one line (0600, owned by the daemon's user)

    def validate(self, key: str) -> None:
        if not self.name or len(self.name) > 64 or not all(c.isalnum() or c in "._@+-" for c in self.name):
            raise ValueError(f"{key}.name: {self.name!r} is not a token name (1-64 of letters, digits, . _ @ + -)")
        if self.name == CONTROL_TOKEN_NAME:
            raise ValueError(f"{key}.name: {CONTROL_TOKEN_NAME!r} is the daemon's own control token")
        if self.role not in ROLES:
            raise ValueError(f"{key}.role: {self.role!r} is not one of {', '.join(ROLES)}")
        if not self.token_file:
            raise ValueError(f"{key}.token_file: must name the file holding the bearer token")


def check_token_names(specs: list[TokenSpec], key: str) -> None:
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise ValueError(f"{key}[{i}].name: {spec.name!r} is used by two tokens")
        seen.add(spec.name)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the token's name and role."""

    name: str
    role: str

    def may(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


class TokenTable:
    """Bearer token -> Caller, compared in constant time against every known token."""

    def __init__(self, entries: Iterable[tuple[str, str, str]]) -> None:  # (name, role, token)
        self._entries = [(token.encode(), Caller(name, role)) for name, role, token in entries]
        values = [t for t, _ in self._entries]
        if len(set(values)) != len(values):
            names = [c.name for t, c in self._entries if values.count(t) > 1]
            raise ValueError(f"api.tokens: {' and '.join(names)} hold the same token: give each its own")

    def caller(self, given: str) -> Caller | None:
        found = None
        for token, caller in self._entries:  # no early return: the same work whichever matches
            if hmac.compare_digest(given.encode(), token):
                found = caller
        return found

