"""Helpers for fleet tests: checkpoint rows seeded straight into a shared registry, and four hosts'
rows with an in-process fleet agent each (`Fleet`)."""

from __future__ import annotations

from pathlib import Path

from daemon.fleet.agent import FleetAgent
from daemon.fleet.settings import FleetSettings, StageSpec
from daemon.registry import Registry, hosts
from daemon.registry.journal import Journal
from daemon.registry.models import Checkpoint
from daemon.registry.status import CheckpointStatus


def seed_versions(reg: Registry, root: Path, statuses: dict[str, CheckpointStatus]) -> dict[str, int]:
    """One verified-looking row per version (its folder made under `root`), in step order."""
    ids = {}
    with reg.session() as s:
        for step, (v, st) in enumerate(statuses.items()):
            (root / v).mkdir(parents=True)
            c = Checkpoint(version=v, source="local:/x", uri=f"file:///x/{v}", local_path=str(root / v), step=step,
                           status=st.value)  # fmt: skip
            s.add(c)
            s.flush()
            ids[v] = c.id
    with reg.session() as s:  # verified_at set: they passed their checks on the registering host
        for c in s.query(Checkpoint):
            c.verified_at = c.discovered_at
    return ids


HOSTS = ("host-0", "host-1", "host-2", "host-3")
PLAN = [StageSpec(hosts=1, bake_s=30), StageSpec(percent=50, bake_s=0)]


class Fleet:
    def __init__(self, url: str, root: Path) -> None:
        self.regs = {h: Registry(url, h) for h in HOSTS}
        self.regs["host-0"].upgrade()
        self.j = {h: Journal(r) for h, r in self.regs.items()}
        for h, j in self.j.items():
            j.register_workers([("w0", "builtin", f"http://{h}", "cpu")])
            j.observe("w0", state="RUNNING", weight_version="v0", error=None, device="cpu")
        self.ids = seed_versions(
            self.regs["host-0"], root, {"v0": CheckpointStatus.DEPLOYED, "v1": CheckpointStatus.VERIFIED,
                                                        "v2": CheckpointStatus.VERIFIED}
        )
        for h in HOSTS[1:]:  # every host has its own copy of each version
            for v, i in self.ids.items():
                (root / h / v).mkdir(parents=True)
                with self.regs[h].session() as s:
                    hosts.set_location(s, i, str(root / h / v))
        for h in HOSTS:
            self.on(h, "v0")
        self.settings = FleetSettings(enabled=True, stages=PLAN)
        self.agents = {h: FleetAgent(j, self.settings, idle=lambda: True, pinned=lambda: None, converge=print,
                                     submit=print) for h, j in self.j.items()}  # fmt: skip

    def on(self, host: str, version: str, passed: bool = True) -> None:
        self.j[host].set_alias("serving", self.ids[version])
        if passed:
            self.j[host].set_alias("last_good", self.ids[version])

    def wants(self, host: str) -> str | None:
        w = self.agents[host].wanted()
        return w[0].version if w is not None else None

    def close(self) -> None:
        for r in self.regs.values():
            r.close()
