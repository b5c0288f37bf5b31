"""The webhook outbox on SQLite and PostgreSQL: a delivery row commits with its event or not at all,
only webhook events and only those a webhook asks for get one, and the signature checks."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from daemon.registry import Registry
from daemon.registry import queries as q
from daemon.registry import status as st
from daemon.registry.models import CheckpointStatus as C
from daemon.registry.webhook_rows import WebhookDelivery
from daemon.webhooks.events import webhook_event
from daemon.webhooks.outbox import install
from daemon.webhooks.settings import WebhookSettings
from daemon.webhooks.signing import sign, verify


def deliveries(reg: Registry) -> list[WebhookDelivery]:
    with reg.session() as s:
        return list(s.scalars(select(WebhookDelivery).order_by(WebhookDelivery.id)))


def test_a_delivery_commits_with_its_event_and_only_what_a_webhook_asks_for(registry: Registry) -> None:
    woken: list[int] = []
    install(registry, [WebhookSettings(name="all", url="http://127.0.0.1:1/"),
                       WebhookSettings(name="bad-news", url="http://127.0.0.1:1/", events=["version.rejected"])],
            wake=lambda: woken.append(1))  # fmt: skip
    with registry.session() as s:
        ckpt = st.create(s, version="v1", source="test", uri="file:///v1", local_path="/v1", commit_signal="manifest")
        assert ckpt is not None
        st.move(s, ckpt, C.VERIFYING)
        st.move(s, ckpt, C.VERIFIED)
        st.note(s, ckpt, "a note: the status to itself, no event")
    assert [(d.webhook, d.event, d.version) for d in deliveries(registry)] == [("all", "version.verified", "v1")]
    assert woken == [1]
    with pytest.raises(RuntimeError), registry.session() as s:  # the event rolls back: its delivery too
        q.record_event(s, to_state="problem_started", detail={"problem": {"kind": "x"}})
        s.flush()
        raise RuntimeError("the transaction fails after the flush")
    assert len(deliveries(registry)) == 1 and woken == [1]
    with registry.session() as s:
        ckpt2 = st.create(s, version="v2", source="test", uri="file:///v2", local_path="/v2", commit_signal="manifest")
        assert ckpt2 is not None
        st.move(s, ckpt2, C.VERIFYING)
        st.move(s, ckpt2, C.REJECTED, "finite: NaN in layers.0", detail={"password": "hunter2"})
        q.record_event(s, to_state="problem_started", detail={"problem": {"kind": "source_unreachable"}})
    rows = deliveries(registry)
    assert [(d.webhook, d.event, d.version) for d in rows[1:]] == [
        ("all", "version.rejected", "v2"), ("bad-news", "version.rejected", "v2"), ("all", "problem.started", None)]
    payload: dict[str, Any] = rows[1].payload
    assert payload["id"] == rows[1].delivery_id and payload["event_id"] == rows[1].event_id
    assert payload["host"] == registry.host and payload["detail"]["password"] == "***"
    assert len({d.delivery_id for d in rows}) == len(rows)
    assert {d.state for d in rows} == {"pending"} and {d.host for d in rows} == {registry.host}


def test_which_events_are_webhook_events() -> None:
    assert webhook_event("verifying", "verified") == "version.verified"
    assert webhook_event("verified", "verified") is None  # a status note
    assert webhook_event(None, "fleet_stage_advanced") == "rollout.stage_advanced"
    assert webhook_event(None, "fleet_rollout_halted") == "rollout.halted"
    assert webhook_event("RUNNING", "DRAINING") is None


def test_the_signature_checks_body_secret_and_age() -> None:
    header = sign(b"k", b'{"a":1}', at=1_000)
    assert verify(b"k", b'{"a":1}', header, now=1_100)
    assert not verify(b"k", b'{"a":2}', header, now=1_100)
    assert not verify(b"other", b'{"a":1}', header, now=1_100)
    assert not verify(b"k", b'{"a":1}', header, now=1_000 + 301)  # a replay past the tolerance
    assert not verify(b"k", b'{"a":1}', "v1=deadbeef", now=1_100)
