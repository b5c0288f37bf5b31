"""The one writer of `serving` and `last_good`: the base model's and each LoRA adapter name's.

A job, the health window, start-up or a broadcast session decides; this module writes what it
decided. Each caller keeps its own order of writes (the fallback path writes last_good before
serving moves, so whoever sees the new serving version sees its last_good too).

    served = ServedVersions(journal, adapter_journal, state, stager.retain)
    served.mark_serving(ckpt, previous, "serving on every worker (rollout 7)")
    served.mark_last_good(ckpt)

`tests/project/test_layout.py` checks that no other module writes these aliases (a `pinned`
alias is an operator's hold, written where the pin is taken).
"""

from __future__ import annotations

from collections.abc import Callable

from daemon.controller.queue import RolloutState
from daemon.registry import AdapterJournal, AdapterVersion, CheckpointRef, CheckpointStatus, Journal

C = CheckpointStatus


class ServedVersions:
    """Writes serving / last_good and what goes with them (see the module docstring)."""

    def __init__(self, journal: Journal, adapters: AdapterJournal, state: RolloutState,
                 retain: Callable[[set[str]], None]) -> None:  # fmt: skip
        self.journal = journal
        self.adapters = adapters
        self.state = state
        self.retain = retain  # the stager frees every staged version but these

    # -- the base model ----------------------------------------------------------------------
    def mark_serving(self, ckpt: CheckpointRef, previous: CheckpointRef | None, message: str,
                     retired_why: str | None = None) -> None:  # fmt: skip
        """`ckpt` serves on every worker: the alias, the runner's state, its status (and the
        replaced version's, `retired_why` its message), and the stager keeps only serving and last_good."""
        self.journal.serve(ckpt.id, self._moves(ckpt, previous, message, retired_why))  # the alias with the statuses
        self.state.set_serving(ckpt.version)
        self._keep_staged(ckpt, self.journal.alias("last_good"))

    def _moves(self, ckpt: CheckpointRef, previous: CheckpointRef | None, message: str,
               retired_why: str | None = None) -> list[tuple[int, CheckpointStatus, str | None]]:  # fmt: skip
        """`ckpt` deployed (a no-op when it is already) and `previous` (when deployed) retired:
        written in one transaction by the caller."""
        moves: list[tuple[int, CheckpointStatus, str | None]] = [(ckpt.id, C.DEPLOYED, message)]
        if previous is not None and previous.id != ckpt.id:
            old = self.journal.checkpoint(previous.id)
            if old is not None and old.status == C.DEPLOYED:
                moves.append((previous.id, C.RETIRED, retired_why or f"replaced by {ckpt.version}"))
        return moves

    def mark_last_good(self, ckpt: CheckpointRef) -> None:
        self.journal.set_alias("last_good", ckpt.id)
        self._keep_staged(ckpt, self.journal.alias("serving"))

    def _keep_staged(self, *keep: CheckpointRef | None) -> None:
        """The stager frees every staged version but serving, last_good and those verified and
        waiting for their rollout. Run when either alias moves: a version that stopped being
        last_good after a health window held a GPU copy (16 GB for 8B) until the next rollout, and
        the next version's staging was deferred for want of that memory."""
        self.retain({c.version for c in keep if c is not None} | {w.version for w in self.journal.waiting()})

    def seed(self, ckpt: CheckpointRef) -> None:
        """Nothing deployed yet and only managed workers: they start on the tiny seed, which is
        serving and last_good from the start (no status move: the seed is registered as deployed)."""
        self.journal.set_alias("serving", ckpt.id)
        self.journal.set_alias("last_good", ckpt.id)

    # -- LoRA adapters, per name ---------------------------------------------------------------
    def mark_adapter_serving(self, av: AdapterVersion, previous: AdapterVersion | None, message: str,
                             bound: Callable[[str], None]) -> None:  # fmt: skip
        """`av` serves its name on every worker; `bound(name)` ends the name's unbound problem
        (daemon.controller.adapter_base) before its status moves."""
        bound(av.name)
        self.adapters.serve(av.name, av.checkpoint.id,  # the alias with the statuses, one transaction
                            self._moves(av.checkpoint, previous.checkpoint if previous is not None else None, message))

    def clear_adapter_serving(self, name: str) -> None:
        """The name is unloaded from every worker: no version of it serves."""
        self.adapters.set_alias(name, "serving", None)

    def mark_adapter_last_good(self, name: str, av: AdapterVersion | None) -> None:
        """None clears it: no version of the name is known good on the serving base."""
        self.adapters.set_alias(name, "last_good", av.checkpoint.id if av is not None else None)
