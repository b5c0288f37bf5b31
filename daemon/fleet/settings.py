"""`[fleet]`: this daemon's host name, and fleet mode (many hosts on one PostgreSQL registry).

    [fleet]
    host = "gpu-07"            # default: this machine's hostname
    enabled = true             # fleet mode: PostgreSQL only
    max_updating_hosts = 1     # hosts rolling out at once, fleet-wide
    lease_s = 60               # a lease not renewed for this long is free again (its daemon died)
    poll_s = 5                 # how often a host looks at the fleet target
    signing_key = "/etc/hotswap/fleet-ed25519.pem"   # sign stage admissions and the target (optional)

    [[fleet.stages]]           # staged rollouts (daemon.fleet.stages): a canary host first ...
    hosts = 1
    bake_s = 60
    gates = ["error-budget"]   # ... whose health window runs these gates too (daemon.gates)
    [[fleet.stages]]           # ... then half the hosts; an implicit last stage takes every host
    percent = 50
    bake_s = 120

`host` alone is fine on SQLite (it names the single host); any fleet-mode setting there is
refused at start (`fleet_problem`), since SQLite is one machine's file.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from daemon.gates import GateSettings, stage_gates_problem


@dataclass
class StageSpec:
    """One stage of a staged fleet rollout: the hosts it brings the version to (in all, with the
    stages before it: a count, a share of the fleet's hosts, or hosts by name) and its bake time."""

    hosts: int = 0  # this many hosts in all by the end of this stage
    percent: float = 0.0  # or this share of the fleet's hosts, rounded up
    names: list[str] = field(default_factory=list)  # or these hosts ([fleet] host of each)
    bake_s: float = 60.0  # every host of the stage passed: wait this long before the next stage
    gates: list[str] = field(default_factory=list)  # [[gates.gate]] names each host of this stage runs in its trial

    def validate(self, key: str) -> None:
        given = [k for k, v in (("hosts", self.hosts), ("percent", self.percent), ("names", self.names)) if v]
        if len(given) != 1:
            raise ValueError(f"{key}: give exactly one of hosts, percent or names (got {', '.join(given) or 'none'})")
        if self.hosts < 0 or not 0 <= self.percent <= 100:
            raise ValueError(f"{key}: hosts must be >= 1 and percent within (0, 100]")
        if self.bake_s < 0:
            raise ValueError(f"{key}.bake_s: must be >= 0")


@dataclass
class FleetSettings:
    host: str = ""  # "" = socket.gethostname()
    enabled: bool = False  # fleet mode: many hosts on one PostgreSQL registry (refused on SQLite)
    max_updating_hosts: int = 1  # hosts rolling out at once, fleet-wide (lease rows)
    lease_s: float = 60.0  # a lease its daemon stopped renewing is free again after this long
    poll_s: float = 5.0  # how often a host checks the fleet target version
    stages: list[StageSpec] = field(default_factory=list)  # staged rollouts (daemon.fleet.stages); none: all at once
    # Ed25519 private key (PEM or 32 raw bytes), the same on every host and operator machine: stage
    # admissions and the fleet target are signed with it and hosts act only on verified ones
    # (daemon.fleet.trust); "" = unsigned (the decider must be a known host that recorded the event)
    signing_key: str = ""

    def validate(self, key: str) -> None:
        # ConfigError lives in daemon.config, which imports this module: plain ValueError here is
        # turned into one by the loader (see daemon.common.typedtoml.build_dataclass)
        if self.max_updating_hosts < 1:
            raise ValueError(f"{key}.max_updating_hosts: must be >= 1")
        if self.lease_s <= 0:
            raise ValueError(f"{key}.lease_s: must be > 0")
        if self.poll_s <= 0:
            raise ValueError(f"{key}.poll_s: must be > 0")
        for i, st in enumerate(self.stages):
            st.validate(f"{key}.stages[{i}]")
        if self.signing_key:
            from daemon.checks import read_ed25519_private

            read_ed25519_private(Path(self.signing_key))  # SignatureError (a ValueError) names the file
        if len(self.host) > 255 or any(c.isspace() for c in self.host):
            raise ValueError(f"{key}.host: {self.host!r} must be a name without spaces (at most 255 characters)")

    @property
    def host_name(self) -> str:
        return self.host or socket.gethostname()

    @property
    def renew_s(self) -> float:
        """How often a held lease is renewed: well inside its lifetime."""
        return max(0.2, self.lease_s / 4)


def fleet_problem(fleet: FleetSettings, database_url: str, gates: GateSettings | None = None) -> str | None:
    """Why fleet mode cannot run on this database, or a stage names a gate not defined (one line), else None."""
    if gates is not None and (problem := stage_gates_problem(gates, [st.gates for st in fleet.stages])):
        return problem
    if not fleet.enabled:
        return "fleet.stages: staged rollouts need fleet mode ([fleet] enabled = true)" if fleet.stages else None
    from sqlalchemy.engine import make_url  # here: reading a config file needs no SQLAlchemy otherwise

    if make_url(database_url).get_backend_name() != "postgresql":
        return ("fleet.enabled: fleet mode needs a PostgreSQL registry ([database] url = "
                "\"postgresql+psycopg://...\"); SQLite is a single host's file")  # fmt: skip
    return None
