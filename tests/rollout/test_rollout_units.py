"""The rollout's pure parts: state machine, planner, waiting-checkpoint queue, config sections."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest

from daemon.config import EMBEDDED, ConfigError, GroupSettings, RolloutSettings, WorkerSpec, parse_config
from daemon.controller.commands import AdapterReconcile, Deploy, Reconcile, Rollback
from daemon.controller.queue import RolloutQueue
from daemon.engines.base import Capabilities, WorkerError
from daemon.registry.journal import CheckpointRef
from daemon.registry.status import CheckpointStatus
from daemon.rollout.planner import modes_of, newer, newest, pauses_safely, plan
from daemon.rollout.states import ALLOWED, IllegalTransition, WorkerState, check_transition

pytestmark = pytest.mark.quick

S = WorkerState

# The transitions of DESIGN.md's diagram, written out independently of states.py.
DIAGRAM = {
    (S.RUNNING, S.DRAINING),
    (S.RUNNING, S.PAUSED),
    (S.DRAINING, S.UPDATED),
    (S.PAUSED, S.UPDATED),
    # the update refused before any write: back to serving what it had (issue 21: not a failure)
    (S.DRAINING, S.RUNNING),
    (S.PAUSED, S.RUNNING),
    (S.UPDATED, S.RUNNING),
    (S.UNHEALTHY, S.RUNNING),
    (S.UNHEALTHY, S.UNHEALTHY),  # restart issued, still down
    *((s, S.UNHEALTHY) for s in S if s != S.UNHEALTHY),  # any --failure--> UNHEALTHY
    # any --failure that may have left it partly updated--> UNCERTAIN --re-installed, checked--> RUNNING
    *((s, S.UNCERTAIN) for s in (S.RUNNING, S.DRAINING, S.PAUSED, S.UPDATED)),
    (S.UNCERTAIN, S.RUNNING),
}


@pytest.mark.parametrize("src,dst", list(itertools.product(S, S)))
def test_state_machine_allows_exactly_the_diagram(src: WorkerState, dst: WorkerState) -> None:
    if (src, dst) in DIAGRAM:
        check_transition("w0", src, dst)
        assert dst in ALLOWED[src]
    else:
        with pytest.raises(IllegalTransition, match=f"worker w0: {src} -> {dst} is not allowed"):
            check_transition("w0", src, dst)


def _workers(*groups: str) -> list[WorkerSpec]:
    return [WorkerSpec(name=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", group=g) for i, g in enumerate(groups)]


def test_plan_batches_by_max_unavailable_in_config_order() -> None:
    workers = _workers("default", "default", "default", "default", "default")
    batches = plan(workers, RolloutSettings(max_unavailable=2))
    assert [b.workers for b in batches] == [("w0", "w1"), ("w2", "w3"), ("w4",)]
    assert {b.mode for b in batches} == {"drain"}


def test_plan_pauses_a_drain_batch_that_would_take_its_whole_group_out_of_rotation() -> None:
    workers = _workers("solo", "pair", "pair", "trio", "trio", "trio")
    cfg = RolloutSettings(mode="drain", groups={"trio": GroupSettings(max_unavailable=3)})
    assert [(b.group, b.mode, b.workers, b.reason) for b in plan(workers, cfg)] == [
        ("solo", "pause", ("w0",), "only worker of group solo: paused instead of drained"),
        ("pair", "drain", ("w1",), None),  # the other one serves meanwhile: drain, one at a time
        ("pair", "drain", ("w2",), None),
        ("trio", "pause", ("w3", "w4", "w5"), "all 3 workers of group trio in one batch: paused instead of drained"),
    ]
    # a group of two rolled one at a time, restricted to one of them: the other still serves
    assert [(b.mode, b.reason) for b in plan(workers, cfg, only={"w2"})] == [("drain", None)]
    # pause mode needs no change, and says nothing
    assert [(b.mode, b.reason) for b in plan(workers[:1], RolloutSettings(mode="pause"))] == [("pause", None)]


def test_plan_drains_a_lone_worker_that_cannot_pause_and_says_the_group_is_out_of_rotation() -> None:
    workers = _workers("solo", "trio", "trio", "trio")
    cfg = RolloutSettings(mode="drain", groups={"trio": GroupSettings(max_unavailable=3)})
    batches = plan(workers, cfg, can_pause=lambda w: w.name not in ("w0", "w2"))
    assert [(b.mode, b.out_of_rotation) for b in batches] == [("drain", True), ("drain", True)]
    assert batches[0].reason == ("only worker of group solo: drained, the group is out of rotation during the "
                                 "update (w0 cannot pause without losing requests)")  # fmt: skip
    assert batches[1].reason is not None and "(w2 cannot pause" in batches[1].reason


def test_pauses_safely_needs_a_pause_that_keeps_requests() -> None:
    spec = WorkerSpec(name="w", url="http://127.0.0.1:1")
    assert pauses_safely(spec, Capabilities(pause_modes=("keep",)))
    assert not pauses_safely(spec, Capabilities(pause_modes=(), can_drain=True))
    # an engine told to abort what is in flight when paused loses requests too
    assert not pauses_safely(WorkerSpec(name="w", url="http://x:1", kind="vllm", pause_mode="abort"),
                             Capabilities(pause_modes=("keep", "wait")))  # fmt: skip


def test_plan_groups_roll_one_after_another_with_their_own_mode() -> None:
    cfg = parse_config(
        {
            "rollout": {"mode": "drain", "groups": {"canary": {"mode": "pause"}, "bulk": {"max_unavailable": 2}}},
            "workers": [
                {"name": "a", "url": "http://127.0.0.1:1", "group": "canary"},
                {"name": "b", "url": "http://127.0.0.1:2", "group": "bulk"},
                {"name": "c", "url": "http://127.0.0.1:3", "group": "bulk"},
                {"name": "d", "url": "http://127.0.0.1:4", "group": "canary"},
                {"name": "e", "url": "http://127.0.0.1:5", "group": "bulk"},
            ],
        },
        "test.toml",
    )
    batches = plan(cfg.workers, cfg.rollout)
    assert [(b.group, b.mode, b.workers) for b in batches] == [
        ("canary", "pause", ("a",)),
        ("canary", "pause", ("d",)),
        ("bulk", "drain", ("b", "c")),
        ("bulk", "drain", ("e",)),
    ]
    assert modes_of(batches) == "mixed"
    assert [b.workers for b in plan(cfg.workers, cfg.rollout, only={"c", "d"})] == [("d",), ("c",)]


def _ref(i: int, step: int | None = None) -> CheckpointRef:
    return CheckpointRef(i, f"v{i}", None, f"/ckpt/v{i}", 21, CheckpointStatus.VERIFIED, True, step)


def test_queue_keeps_only_the_newest_waiting_checkpoint() -> None:
    q = RolloutQueue()
    assert q.offer(_ref(1)) is None
    assert q.offer(_ref(2)) == _ref(1)  # v1 is superseded by v2
    assert q.offer(_ref(3)) == _ref(2)
    assert q.offer(_ref(2)) == _ref(2)  # a late older arrival is itself superseded
    assert q.newer_than(_ref(2)) and not q.newer_than(_ref(3))
    job = q.take(0, deploy_allowed=True)
    assert job == Deploy(_ref(3))
    assert q.take(0, deploy_allowed=True) is None


def test_newer_is_the_manifest_step_then_arrival() -> None:
    """Point 11: step-999 arriving after step-1000 is older; without steps (or on a tie), arrival."""
    s1000, s999 = _ref(1, step=1000), _ref(2, step=999)
    assert newer(s1000, s999) and not newer(s999, s1000)
    assert newer(_ref(2), _ref(1)) and newer(_ref(2, step=5), _ref(1, step=5)) and newer(_ref(2), _ref(1, step=7))
    assert newest([s999, s1000, _ref(3, step=998)]) == s1000
    q = RolloutQueue()
    assert q.offer(s1000) is None
    assert q.offer(s999) == s999  # the late arrival with the lower step is the one superseded
    assert q.pending == s1000 and not q.newer_than(_ref(9, step=1001)) and q.newer_than(_ref(9, step=2))


def test_queue_commands_go_first_and_pinning_holds_deploys() -> None:
    q = RolloutQueue()
    q.offer(_ref(5))
    assert q.take(0, deploy_allowed=False) is None  # pinned: the checkpoint waits
    rollback = Rollback("v1")
    q.command(rollback)
    assert q.take(0, deploy_allowed=True) is rollback
    assert q.take(0, deploy_allowed=True) == Deploy(_ref(5))
    # Reconcile requests coalesce into one job (the base's and the adapters' apart); other commands never do.
    f1, f2, fa = q.command(Reconcile()), q.command(Reconcile()), q.command(AdapterReconcile())
    assert f1 is f2 and fa is not f1 and q.command(AdapterReconcile()) is fa
    assert q.command(Rollback("v1")) is not q.command(Rollback("v1"))
    assert [q.take(0, deploy_allowed=True) for _ in range(4)] == [Reconcile(), AdapterReconcile(), Rollback("v1"), Rollback("v1")]


@pytest.mark.parametrize(
    "doc,message",
    [
        ({"rollout": {"max_unavailable": 0}}, "rollout.max_unavailable: must be >= 1"),
        ({"rollout": {"max_error_rate": 5}}, "rollout.max_error_rate: must be between 0 and 1"),
        ({"rollout": {"transport": "carrier-pigeon"}}, "rollout.transport: 'carrier-pigeon' is not one of"),
        ({"rollout": {"groups": {"g": {"mode": "sleep"}}}}, "rollout.groups.g.mode: 'sleep' is not one of"),
        ({"workers": [{"name": "w0"}]}, "workers[0].url: required for an external worker"),
        ({"workers": [{"name": "w0", "url": "ftp://x"}]}, "workers[0].url: 'ftp://x' is not an http(s) URL"),
        (
            {"workers": [{"name": "w", "url": "http://a:1"}, {"name": "w", "url": "http://a:2"}]},
            "workers[1].name: 'w' is already used by workers[0]",
        ),
        (
            {"workers": [{"name": "a", "url": "http://a:1"}, {"name": "b", "url": "http://a:1/"}]},
            "workers[1].url: 'http://a:1/' is already used by worker 'a'",
        ),
        (
            {"workers": [{"name": "w", "url": "http://a:1", "restart_command": "systemctl restart {unit}"}]},
            "workers[0].restart_command: unknown placeholder {unit}",
        ),
        ({"workers": [{"name": "w", "launch": "managed", "kind": "vllm"}]},
         "workers[0].kind: only builtin workers can be managed, got 'vllm'"),
        ({"workers": [{"name": "w", "url": "http://a:1", "kind": "tgi"}]}, "workers[0].kind: 'tgi' has no adapter"),
        ({"workers": [{"name": "bad name", "url": "http://a:1"}]}, "workers[0].name: 'bad name'"),
    ],
)
def test_bad_rollout_config_names_file_and_key(doc: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(doc, "fleet.toml")
    assert str(err.value).startswith("fleet.toml: ")
    assert message in str(err.value)


def test_default_fleet_is_one_managed_worker_only_without_a_config_file() -> None:
    cfg = parse_config({}, EMBEDDED)
    assert [(w.name, w.launch, w.kind) for w in cfg.workers] == [("local", "managed", "builtin")]
    # one worker: its rollouts hold requests (pause) rather than turn them away (drain), by the
    # planner's general rule, not a setting of its own
    assert cfg.rollout.mode == "drain"
    assert [(b.mode, b.reason) for b in plan(cfg.workers, cfg.rollout)] == [
        ("pause", "only worker of group default: paused instead of drained")]
    assert parse_config({}, "daemon.toml").workers == []  # a file without [[workers]]: verify only
    cfg = parse_config({}, "daemon.toml")
    assert cfg.rollout.max_unavailable == 1 and cfg.rollout.transport == "disk" and cfg.rollout.mode == "drain"
    assert cfg.rollout.health_window_s == 5.0 and cfg.rollout.max_error_rate == 0.01
    spec = WorkerSpec(name="w", url="http://x:1", restart_command="relaunch --model {path} --port {port}")
    assert spec.restart_argv() == ["relaunch", "--model", "{path}", "--port", "{port}"]


class _Mapper:
    """A worker client that can map ahead: records what it is asked, or blocks, or refuses."""

    def __init__(self, name: str, gate: Any = None, refuse: bool = False) -> None:
        self.name, self.gate, self.refuse = name, gate, refuse
        self.asked: list[tuple[str | None, str | None]] = []
        self.done = threading.Event()

    def map_ahead(self, version: str | None, loader: str | None) -> None:
        if self.gate is not None:
            assert self.gate.wait(30)
        self.asked.append((version, loader))
        self.done.set()
        if self.refuse:
            raise WorkerError(f"worker {self.name}: map_ahead: HTTP 503")


def test_workers_that_can_map_ahead_are_asked_each_on_its_own_and_a_stuck_one_delays_nothing() -> None:
    from daemon.rollout.stage import ask_to_map_ahead
    from daemon.rollout.states import WorkerHandle, WorkerSet

    gate = threading.Event()
    stuck, refusing, fine = _Mapper("stuck", gate), _Mapper("refusing", refuse=True), _Mapper("fine")
    cannot = object()  # a client without map_ahead (vLLM, SGLang): never asked
    handles = [WorkerHandle(WorkerSpec(name=c.name, url=f"http://fake/{c.name}", kind="fake"), c, f"http://fake/{c.name}")  # type: ignore[arg-type]
               for c in (stuck, refusing, fine)]  # fmt: skip
    handles.append(WorkerHandle(WorkerSpec(name="cannot", url="http://fake/cannot", kind="fake"), cannot, "http://fake/cannot"))  # type: ignore[arg-type]
    ask_to_map_ahead(WorkerSet(handles))("v7", "/run/loader.sock")  # returns with `stuck` still blocked
    assert fine.done.wait(30) and refusing.done.wait(30)
    assert fine.asked == refusing.asked == [("v7", "/run/loader.sock")] and stuck.asked == []
    gate.set()
    assert stuck.done.wait(30) and stuck.asked == [("v7", "/run/loader.sock")]


def test_a_let_go_never_overtakes_the_ask_it_answers_on_one_worker_and_reads_ahead_are_asked_alike() -> None:
    from daemon.rollout.stage import ask_to_read_ahead
    from daemon.rollout.states import WorkerHandle, WorkerSet

    gate = threading.Event()

    class Reader:
        name = "slow"

        def __init__(self) -> None:
            self.asked: list[tuple[str | None, str | None, str | None]] = []

        def read_ahead(self, version: str | None, path: str | None, alg: str | None, reserve: int = 0) -> None:
            if version is not None:  # the ask is slow; the let-go that follows is not
                assert gate.wait(30)
            self.asked.append((version, path, alg))

    r = Reader()
    ask = ask_to_read_ahead(WorkerSet([WorkerHandle(WorkerSpec(name="slow", url="http://fake/slow", kind="fake"), r, "http://fake/slow")]))  # type: ignore[arg-type]
    ask("v7", "/ckpt/v7", "blake3", 100)
    ask(None, None, None, 0)  # the version failed its checks while the worker was still being asked
    gate.set()
    deadline = time.monotonic() + 30
    while len(r.asked) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.asked == [("v7", "/ckpt/v7", "blake3"), (None, None, None)]


def test_each_read_ahead_leaves_room_for_the_other_workers_buffers_and_the_checks_copy() -> None:
    """Seen on an 80 GB H100: two workers' read-aheads (16 GB each, asked at once) took the memory
    the forward check needed. Each worker is asked to keep free, beside its own buffer, a copy of
    the version for every other worker asked and one for the checks: race-free, since the asks go
    out at once and no worker can count on seeing the others' allocations."""
    from daemon.rollout.stage import WorkerAsks
    from daemon.rollout.states import WorkerHandle, WorkerSet

    class Reader:
        def __init__(self, name: str) -> None:
            self.name, self.reserves = name, []

        def read_ahead(self, version: str | None, path: str | None, alg: str | None, reserve: int = 0) -> None:
            self.reserves.append(reserve)

    readers = [Reader("w0"), Reader("w1")]
    handles = [WorkerHandle(WorkerSpec(name=r.name, url=f"http://fake/{r.name}", kind="fake"), r, f"http://fake/{r.name}")
               for r in readers]  # type: ignore[arg-type]  # fmt: skip
    asks = WorkerAsks(WorkerSet(handles))
    asks.read_ahead("v7", "/ckpt/v7", "blake3", 16 << 30)
    assert asks.settle(30)
    assert [r.reserves for r in readers] == [[32 << 30], [32 << 30]]  # the other worker's copy + the checks'


def test_worker_asks_settle_once_every_ask_was_answered_and_say_so_when_one_hangs() -> None:
    from daemon.rollout.stage import WorkerAsks
    from daemon.rollout.states import WorkerHandle, WorkerSet

    gate = threading.Event()
    slow = _Mapper("slow", gate)
    asks = WorkerAsks(WorkerSet([WorkerHandle(WorkerSpec(name="slow", url="http://fake/slow", kind="fake"), slow, "http://fake/slow")]))  # type: ignore[arg-type]
    assert asks.settle(0.0)  # nothing asked: settled
    asks.map_ahead("v7", "/run/loader.sock")
    assert not asks.settle(0.2) and slow.asked == []  # still on its way: a prepare now would overtake it
    gate.set()
    assert asks.settle(30) and slow.asked == [("v7", "/run/loader.sock")]
