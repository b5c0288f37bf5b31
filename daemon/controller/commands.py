"""What the rollout runner can be asked to do: one small command per job, carrying its own data.

An operator's rollback, pin and unpin (the base's, or one adapter name's), the fleet's converge, a
reconcile, and a new version's deploy (the base's, handed out by the queue's waiting slot, or an
adapter's) are each a `Command`: its arguments, who asked (`by`: the API token's name,
daemon.common.tokens, recorded in its events), the Future the API waits on, and `run`: the one
call it makes on what the service holds (`Steps`: the base's decisions,
daemon.controller.decisions, and the adapters', daemon.controller.adapters).

    service.queue.command(Pin("v3", force=False, by="alice")).result()

The runner (daemon.controller.service) runs whatever the queue (daemon.controller.queue) hands
it and never asks which one it holds; a new job is one class here and the call that queues it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from daemon.registry import CheckpointRef

Result = dict[str, Any]  # what the API answers
OPEN = "open"  # a result's `health_window` while its window is open: the verdict replaces it (`settled`)


class BaseSteps(Protocol):  # daemon.controller.decisions.RolloutDecisions
    def deploy_new(self, ckpt: CheckpointRef) -> Result: ...
    def rollback(self, to: str | None, by: str) -> Result: ...
    def pin(self, version: str, force: bool, by: str) -> Result: ...
    def unpin(self, by: str) -> Result: ...
    def converge(self, version: str) -> Result: ...
    def reconcile(self) -> Result: ...
    def resume_window(self, ckpt: CheckpointRef, rollout_id: int, fallback: CheckpointRef | None) -> Result: ...


class Rebase(Protocol):  # daemon.controller.adapter_base.BaseBinding
    def rebase(self) -> Result: ...


class AdapterSteps(Protocol):  # daemon.controller.adapters.AdapterDecisions
    def deploy_new(self, checkpoint_id: int, hold: bool = False) -> Result: ...
    def rollback(self, name: str | None, to: str | None, by: str) -> Result: ...
    def pin(self, version: str, force: bool, by: str) -> Result: ...
    def unpin(self, name: str, by: str) -> Result: ...
    def reconcile(self) -> Result: ...
    @property
    def binding(self) -> Rebase: ...


class Steps(Protocol):
    """What a command runs against: the rollout service's two deciders."""

    @property
    def decisions(self) -> BaseSteps: ...
    @property
    def adapters(self) -> AdapterSteps: ...


@dataclass
class Command:
    """One job of the runner. Two equal ones (same class, same data) are the same request."""

    future: Future[Result] = field(default_factory=Future, kw_only=True, compare=False, repr=False)
    once: ClassVar[bool] = False  # queued at most once: asked again, the caller shares the queued one's Future

    def run(self, on: Steps) -> Result:
        """Do it, on the runner thread; a refusal raises daemon.controller.queue.CommandError."""
        raise NotImplementedError

    def describe(self) -> str:
        """For logs and status's `current` ("pin v3"; daemon.fleet.behind reads "converge VERSION")."""
        raise NotImplementedError

    def settled(self, on: Steps, out: Result) -> Result:
        """The rest of a job whose `run` left a health window open (`out["health_window"] == OPEN`),
        once the runner has its verdict in `out`."""
        return out


def _adapters_follow(on: Steps, out: Result) -> Result:
    """A base job done: each served adapter held to the serving base (daemon.controller.adapter_base);
    after its health window's verdict when one is open."""
    if out.get("health_window") == OPEN:
        return out
    rebased = on.adapters.binding.rebase() if out.get("outcome") != "waiting" else {}
    return {**out, "adapters_rebased": rebased} if rebased else out


# -- the base model's ------------------------------------------------------------------------
@dataclass
class Deploy(Command):  # the waiting checkpoint: the queue hands it out when no command waits
    checkpoint: CheckpointRef

    def run(self, on: Steps) -> Result:
        return _adapters_follow(on, on.decisions.deploy_new(self.checkpoint))

    def settled(self, on: Steps, out: Result) -> Result:
        return _adapters_follow(on, out)

    def describe(self) -> str:
        return f"deploy {self.checkpoint.version}"


@dataclass
class Rollback(Command):  # back to the version before serving, or to `to`
    to: str | None = None
    by: str = "operator"

    def run(self, on: Steps) -> Result:
        return _adapters_follow(on, on.decisions.rollback(self.to, self.by))

    def describe(self) -> str:
        return f"rollback {self.to}" if self.to else "rollback"


@dataclass
class ResumeWindow(Command):  # the daemon stopped inside `checkpoint`'s health window: it is watched again
    checkpoint: CheckpointRef
    rollout_id: int
    fallback: CheckpointRef | None  # where a failed window goes back to (last_good)

    def run(self, on: Steps) -> Result:
        return on.decisions.resume_window(self.checkpoint, self.rollout_id, self.fallback)

    def describe(self) -> str:
        return f"health window {self.checkpoint.version}"


@dataclass
class Pin(Command):  # deploy `version` and hold it; a rejected one only with `force`
    version: str
    force: bool = False
    by: str = "operator"

    def run(self, on: Steps) -> Result:
        return _adapters_follow(on, on.decisions.pin(self.version, self.force, self.by))

    def describe(self) -> str:
        return f"pin {self.version}"


@dataclass
class Unpin(Command):
    by: str = "operator"

    def run(self, on: Steps) -> Result:
        return _adapters_follow(on, on.decisions.unpin(self.by))

    def describe(self) -> str:
        return "unpin"


@dataclass
class Converge(Command):  # fleet mode: onto the fleet target `version` (daemon.fleet.agent)
    version: str

    def run(self, on: Steps) -> Result:
        return _adapters_follow(on, on.decisions.converge(self.version))

    def settled(self, on: Steps, out: Result) -> Result:
        return _adapters_follow(on, out)

    def describe(self) -> str:
        return f"converge {self.version}"


@dataclass
class Reconcile(Command):  # drifted workers back onto serving (a managed worker's fallback first)
    once: ClassVar[bool] = True

    def run(self, on: Steps) -> Result:
        return _adapters_follow(on, on.decisions.reconcile())

    def describe(self) -> str:
        return "reconcile"


# -- one adapter name's (LoRA: loaded with no worker leaving RUNNING) -------------------------
@dataclass
class AdapterDeploy(Command):
    checkpoint: CheckpointRef

    def run(self, on: Steps) -> Result:
        return on.adapters.deploy_new(self.checkpoint.id, hold=True)

    def describe(self) -> str:
        return f"adapter {self.checkpoint.version}"


@dataclass
class AdapterRollback(Command):  # `adapter` back to its version before, or to the adapter version `to`
    adapter: str | None = None
    to: str | None = None
    by: str = "operator"

    def run(self, on: Steps) -> Result:
        return on.adapters.rollback(self.adapter, self.to, self.by)

    def describe(self) -> str:
        what = self.to or self.adapter
        return f"adapter_rollback {what}" if what else "adapter_rollback"


@dataclass
class AdapterPin(Command):
    version: str
    force: bool = False
    by: str = "operator"

    def run(self, on: Steps) -> Result:
        return on.adapters.pin(self.version, self.force, self.by)

    def describe(self) -> str:
        return f"adapter_pin {self.version}"


@dataclass
class AdapterUnpin(Command):
    adapter: str
    by: str = "operator"

    def run(self, on: Steps) -> Result:
        return on.adapters.unpin(self.adapter, self.by)

    def describe(self) -> str:
        return f"adapter_unpin {self.adapter}"


@dataclass
class AdapterReconcile(Command):  # each adapter name's serving version on every worker, newer ones deployed
    once: ClassVar[bool] = True

    def run(self, on: Steps) -> Result:
        return on.adapters.reconcile()

    def describe(self) -> str:
        return "adapter_reconcile"
