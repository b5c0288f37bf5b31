"""The three registries (sources, transports, worker kinds): every entry resolves to what its
protocol names, and a new transport plugs in with one module and one registry line (the toy
`memory` transport of fake_transport.py) through both sides: config, stager, the worker's update
path (copy and swap) and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fake_transport import RELEASED, SHELF

from daemon import engines, sources, transport
from daemon.config import parse_config
from daemon.engines.base import Timeouts
from daemon.registry.journal import CheckpointRef
from daemon.registry.status import CheckpointStatus
from daemon.rollout.stage import Stager
from daemon.transport.base import SenderOptions
from daemon.worker import updates
from daemon.worker.store import VersionRecord, WeightStore

pytestmark = pytest.mark.quick


def test_every_registry_entry_resolves(tmp_path: Path) -> None:
    for name in sources.SOURCE_TYPES:
        cls = sources.source_type(name)
        assert callable(cls) and hasattr(cls, "config_type")
    for name, entry in transport.TRANSPORTS.items():
        sender = transport.daemon_transport(name, SenderOptions(tmp_path))
        assert sender.name == name
        module, attr = entry.worker_side.split(":")
        assert callable(getattr(__import__(module, fromlist=[attr]), attr))
    for kind in engines.WORKER_KINDS:
        client = engines.make_client(kind, "w0", "http://127.0.0.1:9", token_file=None, timeouts=Timeouts())
        assert set(client.capabilities.transports) <= set(transport.TRANSPORTS)
        client.close()
    assert engines.MANAGED_KIND in engines.WORKER_KINDS


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(transport.TRANSPORTS, "memory", transport.TransportEntry(  # the one registry line
        "fake_transport:MemorySender", "fake_transport:open_update"))


def _store() -> WeightStore:
    params = {"a": torch.zeros(4), "b": torch.zeros(2, 3)}
    return WeightStore(params, torch.device("cpu"), VersionRecord("v0", None, "disk", "/v0", request={"path": "/v0"}))


def test_a_new_transport_is_one_module_and_one_registry_line(tmp_path: Path, memory: None) -> None:
    assert parse_config({"rollout": {"transport": "memory"}}, "t.toml").rollout.transport == "memory"
    SHELF["v1"] = {"a": torch.arange(4.0), "b": torch.ones(2, 3)}
    ref = CheckpointRef(1, "v1", None, None, 2, CheckpointStatus.VERIFIED, True)
    target = Stager("memory", SenderOptions(tmp_path)).target(ref)  # the daemon side
    assert target.request.to_json() == {"version": "v1", "transport": "memory", "mode": "copy", "key": "v1",
                                        "expect": {"tensors": 2}}  # fmt: skip
    store = _store()
    ptrs = store.data_ptrs()
    result = updates.apply_update(store, updates.parse_request(target.request.to_json()))  # the worker side
    assert result["memory_tensors"] == 2 and result["digest_checked"] is False
    assert torch.equal(store.params["a"], torch.arange(4.0)) and store.data_ptrs() == ptrs  # in place

    SHELF["v2"] = {"a": torch.full((4,), 7.0), "b": torch.full((2, 3), 7.0)}
    swapped = updates.apply_update(store, updates.parse_request({"version": "v2", "transport": "memory", "mode": "swap",
                                                                  "key": "v2"}))  # fmt: skip
    assert swapped["mode"] == "swap" and store.params["a"].data_ptr() == SHELF["v2"]["a"].data_ptr()
    back = updates.rollback(store)  # a pointer flip back onto the worker's own storage
    assert back["version"] == "v1" and store.data_ptrs() == ptrs and torch.equal(store.params["a"], torch.arange(4.0))
    assert RELEASED == []  # v2 is still retained for a rollback


def test_the_worker_refuses_what_the_registry_or_the_transport_cannot_take(memory: None) -> None:
    store = _store()
    with pytest.raises(updates.BadRequest, match="unknown transport 'pigeon'; this worker has"):
        updates.parse_request({"version": "x", "transport": "pigeon"})
    with pytest.raises(updates.BadRequest, match="mode 'swap' is not supported for transport 'disk'"):
        updates.apply_update(store, updates.parse_request({"version": "x", "transport": "disk", "mode": "swap",
                                                            "path": "/nowhere"}))  # fmt: skip
    with pytest.raises(updates.BadRequest, match="needs 'key'"):
        updates.apply_update(store, updates.parse_request({"version": "x", "transport": "memory"}))
    SHELF["wide"] = {"a": torch.zeros(5), "b": torch.zeros(2, 3)}
    with pytest.raises(updates.Refused, match="shape"):
        updates.apply_update(store, updates.parse_request({"version": "w", "transport": "memory", "key": "wide"}))
    with pytest.raises(updates.BadRequest, match="expect.files"):
        updates.parse_request({"version": "x", "expect": {"files": [{"path": 3}]}})
    assert store.current.version == "v0"
