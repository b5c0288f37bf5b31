"""The database alone cannot steer a fleet (daemon.fleet.trust), on a real PostgreSQL with real
roles: a login without grants holding the old advisory key stalls nothing and cannot take the new
row lock; a session holding the row lock is named as `fleet_stalled` (the agent's problem, the
rollout's row, `status --fleet`); a role with INSERT only on `fleet_rollout_hosts` and
`fleet_target` (and on `events`, where a signing key is set) cannot admit a host or retarget the
fleet. The same with real daemons: tests/e2e/test_fleet_trust_daemons.py."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import POSTGRES_ENV
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError
from support_fleet import HOSTS, Fleet

from daemon.fleet import stages
from daemon.fleet.agent import FleetAgent
from daemon.fleet.settings import FleetSettings
from daemon.fleet.target import fleet_rows, fleet_target, set_fleet_target
from daemon.fleet.trust import STALL_POLLS, Trust

pytestmark = [pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}"), pytest.mark.quick]
OLD_LOCK_KEY = 0x686F7473  # the advisory key decisions took at d23160d


@contextmanager
def role(url: str, *grants: str) -> Iterator[Connection]:
    """A connection as a fresh LOGIN role holding only `grants` (e.g. "INSERT ON fleet_target")."""
    name = f"r_{secrets.token_hex(4)}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f"CREATE ROLE {name} LOGIN"))
        for g in grants:
            c.execute(text(f"GRANT {g} TO {name}"))
    engine = create_engine(make_url(url).set(username=name, password=None), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()
        with admin.connect() as c:
            c.execute(text(f"DROP OWNED BY {name}"))
            c.execute(text(f"DROP ROLE {name}"))
        admin.dispose()


@pytest.fixture
def fleet(pg_url: str, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(pg_url, tmp_path)
    yield f
    f.close()


def keyed(fleet: Fleet, tmp_path: Path) -> Trust:
    """Every host's agent with one [fleet] signing_key (a fresh Ed25519 key in a PEM file)."""
    pem = tmp_path / "fleet.pem"
    pem.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
    fleet.settings = FleetSettings(enabled=True, stages=fleet.settings.stages, signing_key=str(pem))
    fleet.agents = {h: FleetAgent(j, fleet.settings, idle=lambda: True, pinned=lambda: None, converge=print,
                                  submit=print) for h, j in fleet.j.items()}  # fmt: skip
    return Trust.from_file(pem)


def kinds(agent: FleetAgent) -> dict[str, str]:
    return {p.kind: p.reason for p in agent.problems()}


def test_a_login_without_grants_stalls_nothing_and_cannot_take_the_decision_lock(fleet: Fleet, pg_url: str) -> None:
    with role(pg_url) as nobody:
        assert nobody.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": OLD_LOCK_KEY}).scalar()  # held
        with pytest.raises(ProgrammingError, match="permission denied"):
            nobody.execute(text("SELECT * FROM fleet_decider FOR UPDATE"))
        v1 = fleet.j["host-2"].checkpoint(fleet.ids["v1"])
        assert v1 is not None
        assert fleet.agents["host-2"].admits(v1)  # begun and its canary admitted at once, key held or not
        assert [fleet.wants(h) for h in HOSTS] == [None, None, "v1", None]


def test_a_session_holding_the_decision_lock_is_named_fleet_stalled(fleet: Fleet, pg_url: str) -> None:
    v1 = fleet.j["host-2"].checkpoint(fleet.ids["v1"])
    assert v1 is not None
    holder = create_engine(pg_url).connect()  # a fleet-role session (it may UPDATE fleet_decider)
    try:
        holder.execute(text("SELECT * FROM fleet_decider FOR UPDATE"))
        assert not fleet.agents["host-2"].admits(v1)  # begun, but nobody may decide its canary
        agent = fleet.agents["host-1"]
        for n in range(1, STALL_POLLS + 1):
            assert "fleet_stalled" not in kinds(agent), n
            agent.tick()
        reason = kinds(agent)["fleet_stalled"]
        assert "fleet_stage_admitted due for 5 polls" in reason and "fleet_decider" in reason, reason
        assert fleet_rows(fleet.regs["host-0"])["stalled"] == reason  # what `status --fleet` prints
        assert (stages.status(fleet.regs["host-0"]) or {})["stalled"] == reason
    finally:
        holder.rollback()
        holder.close()
    agent.tick()  # the lock is free: this host decides
    assert "fleet_stalled" not in kinds(agent)
    assert [fleet.wants(h) for h in HOSTS] == [None, None, "v1", None]
    assert fleet_rows(fleet.regs["host-0"])["stalled"] is None


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_role_with_insert_only_can_neither_admit_a_host_nor_retarget_the_fleet(
    fleet: Fleet, pg_url: str, tmp_path: Path, signed: bool
) -> None:
    trust = keyed(fleet, tmp_path) if signed else Trust()
    v1 = fleet.j["host-2"].checkpoint(fleet.ids["v1"])
    assert v1 is not None and fleet.agents["host-2"].admits(v1)  # host-2: the canary, rightly admitted
    (rid,) = fleet.regs["host-0"].engine.connect().execute(text("SELECT id FROM fleet_rollouts")).one()
    grants = ["INSERT ON fleet_rollout_hosts", "INSERT ON fleet_target"]
    if signed:  # with a key, even the events the unsigned rules read can be forged: the signature cannot
        grants += ["INSERT ON events", "USAGE ON SEQUENCE events_id_seq"]
    with role(pg_url, *grants) as forger:
        forger.execute(text("INSERT INTO fleet_rollout_hosts (rollout_id, host, stage, admitted_at, decided_by, tick, "
                            "signature) VALUES (:r, 'host-0', 0, now(), 'host-2', 1, :sig)"),
                       {"r": rid, "sig": "AAAA" if signed else None})  # fmt: skip
        forger.execute(text("INSERT INTO fleet_target (id, checkpoint_id, set_at, set_by) VALUES (1, :c, now(), "
                            "'alice (forged)')"), {"c": fleet.ids["v2"]})  # fmt: skip
        if signed:
            forger.execute(text("INSERT INTO events (at, host, checkpoint_id, to_state, detail) VALUES (now(), 'host-2', "
                                ":c, 'fleet_stage_admitted', :d)"),
                           {"c": fleet.ids["v1"], "d": f'{{"rollout_id": {rid}, "hosts": ["host-0"]}}'})  # fmt: skip
            forger.execute(text("INSERT INTO events (at, host, checkpoint_id, to_state, detail) VALUES (now(), 'ops', "
                                ":c, 'fleet_target_set', :d)"),
                           {"c": fleet.ids["v2"], "d": '{"by": "alice (forged)"}'})  # fmt: skip
    agent = fleet.agents["host-0"]
    assert not stages.admitted(fleet.j["host-0"], v1, fleet.settings, None, agent.trust)
    target = fleet_target(fleet.j["host-0"], agent.trust)
    assert target is not None and not target.explicit and target.checkpoint.version == "v0"
    assert [fleet.wants(h) for h in HOSTS] == [None, None, "v1", None]  # nobody takes v2, host-0 not v1
    agent.tick()  # the look that decides (this host takes the lock) and names what it refused
    refused = kinds(agent)["fleet_decision_refused"]
    assert "admission of host-0 to stage 0" in refused and "v2 set by 'alice (forged)': refused" in refused, refused
    doc = fleet_rows(fleet.regs["host-1"], agent.trust)
    assert doc["target"] == "v0" and "alice (forged)" in doc["target_refused"]
    with fleet.regs["host-0"].engine.connect() as c:  # the decider deleted the forged admission, saying why
        assert c.execute(text("SELECT host FROM fleet_rollout_hosts")).scalars().all() == ["host-2"]
        assert c.execute(text("SELECT count(*) FROM events WHERE to_state = 'fleet_admission_refused'")).scalar() == 1
    assert [fleet.wants(h) for h in HOSTS] == [None, None, "v1", None]
    # the operator's own target (signed with the key where one is set) is followed
    set_fleet_target(fleet.regs["host-3"], "v0", by="ops", trust=trust)
    target = fleet_target(fleet.j["host-0"], agent.trust)
    assert target is not None and target.explicit and target.set_by == "ops"
