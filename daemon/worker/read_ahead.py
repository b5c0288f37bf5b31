"""A disk version read ahead of its verification (issue 41): while the daemon still verifies a
version on the disk transport, it asks each worker to read that version's files into a buffer of
the worker's own (`read_ahead`), hashing every file as it goes. The prepare (or update) that
follows verification then takes that buffer instead of reading the 16 GB a second time, but only
when what was read is exactly what the registry verified: every file read is listed in the
request's `expect.files` with the same size and strong digest, and every listed weight file was
read (`DiskTransport.vouch`). Anything else lets the buffer go and reads as before.

Only where the prepare would read ahead too (`--stage-disk`: auto on CUDA, on): elsewhere a read
ahead reads nothing and holds nothing. At most one version is held, let go when a prepare or
update takes it or refuses it, when the daemon says so (`want(None)`: the version failed its
checks), when another version is asked for, or after `hold_s` unused (checked on each weight_info).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from daemon.transport import DiskTransport, Expect, UpdateRequest
from daemon.worker.store import WeightStore
from daemon.worker.updates import Opened, open_and_validate

# Unused this long, a read-ahead buffer (as large as the model) is let go: the prepare follows
# verification within a second when nothing waits.
HOLD_S = 15.0
# A prepare for the version being read ahead waits this long for that read before reading itself.
WAIT_S = 60.0


class ReadAhead:
    def __init__(self, store: WeightStore, event: Callable[..., None], hold_s: float = HOLD_S) -> None:
        self.store = store
        self.event = event  # the worker's event log (control.WorkerControl.event)
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._wanted = 0  # bumped by each want(): a read that finishes after a newer want is let go
        self._reading: tuple[int, str, str, threading.Event] | None = None  # (ticket, version, path, done)
        self._held: tuple[str, str, Opened, float] | None = None  # (version, path, opened, since)

    def want(self, version: str | None, path: str | None, alg: str | None, reserve: int = 0) -> None:
        """Read `version` from directory `path`, hashed with `alg`, on a thread of its own (the
        daemon does not wait for it), only when the device keeps `reserve` bytes free beside the
        buffer (room for the other workers' read-aheads and the checks' copy); None: let go of
        what is held."""
        with self._lock:
            self._wanted += 1
            ticket, held, self._held = self._wanted, self._held, None
            done = threading.Event()
            self._reading = (ticket, version, path, done) if version is not None and path is not None else None
        self._release(held, "replaced" if version is not None else "let_go")
        if version is not None and version == self.store.current.version:  # an ask that came after its update
            self.event("read_ahead_skipped", version=version, why="serving it already")
            return
        if version is not None and path is not None and alg is not None:
            threading.Thread(target=self._read, args=(ticket, version, path, alg, reserve, done), name=f"read-ahead-{version}",
                             daemon=True).start()  # fmt: skip

    def _read(self, ticket: int, version: str, path: str, alg: str, reserve: int, done: threading.Event) -> None:
        t0 = time.perf_counter()
        opened: Opened | None = None
        try:
            opened = open_and_validate(UpdateRequest(version, "disk", {"path": path}, "copy", Expect()), self.store,
                                       open_transport=lambda _r, store: _transport(path, alg, store, reserve))  # fmt: skip
            transport = opened.transport
            assert isinstance(transport, DiskTransport)
            transport.stage(self.store.params)
            if transport.ahead is None:  # staging off here, or no room: nothing to gain
                self.event("read_ahead_skipped", version=version, why=transport.ahead_note or "--stage-disk")
                opened.transport.close()
                opened = None
        except Exception as exc:  # noqa: BLE001  (only a head start lost: the prepare reads as before)
            self.event("read_ahead_failed", version=version, error=f"{type(exc).__name__}: {exc}")
            if opened is not None:
                opened.transport.close()
            opened = None
        with self._lock:
            current = self._reading is not None and self._reading[0] == ticket
            if current:
                self._reading = None
                if opened is not None:
                    self._held = (version, path, opened, time.monotonic())
                    # said before anyone can take it: the event log reads in the order things happened
                    self.event("read_ahead", version=version, read_ms=round((time.perf_counter() - t0) * 1e3, 3))
        done.set()
        if opened is not None and not current:
            self._release((version, path, opened, 0.0), "replaced")

    def take(self, request: UpdateRequest) -> Opened | None:
        """What was read ahead for exactly this disk copy update, once its digests vouch for it
        (waiting for a read of it still under way); None: the caller opens and reads as before."""
        if request.transport != "disk" or request.mode != "copy":
            return None
        path = request.source.get("path")
        with self._lock:
            reading = self._reading
        if reading is not None and reading[1:3] == (request.version, path):
            reading[3].wait(WAIT_S)
        with self._lock:
            held = self._held
            if held is None or held[:2] != (request.version, path):
                return None
            self._held = None
        opened = held[2]
        assert isinstance(opened.transport, DiskTransport)
        why = opened.transport.vouch(request.expect)
        expect = request.expect
        if why is None and expect.tensors is not None and expect.tensors != len(opened.transport.table()):
            why = f"expected {expect.tensors} tensors, {len(opened.transport.table())} were read"
        if why is None and expect.digest is not None and opened.digest is not None and opened.digest != expect.digest:
            why = f"expected digest {expect.digest}, the manifest read ahead says {opened.digest}"
        if why is not None:
            self._release(held, f"refused: {why}")
            return None
        self.event("read_ahead_taken", version=request.version)
        return opened

    def expire(self) -> None:
        with self._lock:
            held = self._held
            if held is None or time.monotonic() - held[3] < self.hold_s:
                return
            self._held = None
        self._release(held, "expired")

    def version(self) -> str | None:
        with self._lock:
            return None if self._held is None else self._held[0]

    def _release(self, held: tuple[str, str, Opened, float] | None, why: str) -> None:
        if held is None:
            return
        held[2].transport.close()  # never given to the store: nothing of it is served
        self.event("read_ahead_released", version=held[0], why=why)


def _transport(path: str, alg: str, store: Any, reserve: int = 0) -> DiskTransport:
    tr = DiskTransport(path, compute_alg=alg)
    tr.reserve_bytes = reserve
    tr.stage_ahead = getattr(store, "stage_disk", "auto")
    tr.flat = getattr(store, "flat", None)
    return tr
