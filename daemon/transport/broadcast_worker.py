"""The worker side of the broadcast transport: join a trainer's group, receive into the parameters.

    join(spec, model_dir, device)   POST /admin/init_weight_group: connect to the trainer's store
                                    and build the process group (blocks until every rank is there,
                                    at most spec.timeout_s); kept by group name until its update
    open_update(request, store)     the registry's worker entry, for POST /admin/update
                                    {transport: "broadcast", version, table, group_name,
                                     bucket_bytes, keep_at?, restore_from?}

The update (`BroadcastReceiver`), in the order `daemon.worker.updates` drives it:
`open()` checks the table against the live parameters and joins the group's "ready" vote (a
refused table anywhere stops every member before a byte moves); `write_into` receives the
buckets straight into the parameters, hashing the bytes as they come, checks every floating
tensor is finite, optionally saves the version to `keep_at` (the daemon's copy on disk, so
the version can be restored and rolled back to later), then joins the "done" vote. Any error
or timeout raises, and the update path restores the current version before anything is
served. `close()` always aborts the group: no communicator is left half-open.

A request whose group is gone (the restore of a broadcast version after a later update
failed, or a rollback to it) reads the version back from `restore_from` with the disk
transport: the table check and the write go through the same code as any disk update.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from daemon.formats import MANIFEST_NAME
from daemon.transport.base import (
    BadUpdateRequest,
    TableMismatch,
    TensorSpec,
    TransportError,
    UpdateRequest,
    WorkerTransport,
    check_table,
)
from daemon.transport.broadcast import (
    DEFAULT_BUCKET_BYTES,
    buckets,
    parse_table,
    stream_digest,
    stream_hasher,
    total_bytes,
)
from daemon.transport.disk import DiskTransport
from daemon.transport.group_spec import GroupSpec

log = logging.getLogger("hotswap.transport.broadcast")


@dataclass
class Group:
    spec: GroupSpec
    pg: Any
    store: Any
    model_dir: str
    comm_device: torch.device
    expires: threading.Timer | None = None
    joined_at: float = field(default_factory=time.time)

    def abort(self) -> None:
        if self.expires is not None:
            self.expires.cancel()
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None:
            for how in ("abort", "shutdown"):
                fn = getattr(pg, how, None)
                if fn is not None:
                    with contextlib.suppress(Exception):
                        fn()
                    break


_LOCK = threading.Lock()
_GROUPS: dict[str, Group] = {}


def pending_groups() -> list[str]:
    with _LOCK:
        return sorted(_GROUPS)


def _drop(name: str, group: Group | None = None) -> None:
    with _LOCK:
        g = _GROUPS.get(name)
        if g is None or (group is not None and g is not group):
            return
        del _GROUPS[name]
    g.abort()
    log.warning("weight group %s was joined but never used within its timeout; aborted", name)


def join(spec: GroupSpec, model_dir: str, device: torch.device) -> dict[str, Any]:
    """Connect to the trainer's TCP store and build the group; raises TransportError on failure."""
    backend = spec.backend
    if backend == "nccl" and device.type != "cuda":
        raise BadUpdateRequest(f"backend 'nccl' needs a CUDA worker; this one runs on {device}")
    timeout = timedelta(seconds=spec.timeout_s)
    t0 = time.perf_counter()
    with _LOCK:
        old = _GROUPS.pop(spec.group_name, None)
    if old is not None:
        old.abort()
    try:
        tcp = dist.TCPStore(spec.master_address, spec.master_port, None, False, timeout)
        store = dist.PrefixStore(f"hotswap/{spec.group_name}/", tcp)
        if backend == "gloo":
            pg: Any = dist.ProcessGroupGloo(store, spec.rank_offset, spec.world_size, timeout)
            comm = torch.device("cpu")
        else:
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, spec.rank_offset, spec.world_size, opts)
            comm = device
    except Exception as exc:
        raise TransportError(f"cannot join weight group {spec.group_name!r} at "
                             f"{spec.master_address}:{spec.master_port}: {exc}") from None  # fmt: skip
    group = Group(spec, pg, tcp, model_dir, comm)
    # a group joined but never used (the daemon died between join and update) goes away by itself
    group.expires = threading.Timer(spec.timeout_s * 2 + 5, _drop, (spec.group_name, group))
    group.expires.daemon = True
    with _LOCK:
        _GROUPS[spec.group_name] = group
    group.expires.start()
    return {"group_name": spec.group_name, "rank": spec.rank_offset, "world_size": spec.world_size,
            "backend": backend, "join_ms": (time.perf_counter() - t0) * 1e3}  # fmt: skip


def open_update(request: UpdateRequest, store: Any) -> WorkerTransport:
    """Worker side, from an update request (see the module docstring)."""
    src = request.source
    name = src.get("group_name")
    if not isinstance(name, str) or not name:
        raise BadUpdateRequest("broadcast transport needs 'group_name' (the group joined by /admin/init_weight_group)")
    with _LOCK:
        group = _GROUPS.pop(name, None)
    if group is None:
        restore_from = src.get("restore_from")
        if isinstance(restore_from, str) and restore_from and Path(restore_from).is_dir():
            return DiskTransport(restore_from)
        raise BadUpdateRequest(f"no weight group {name!r} is joined: POST /admin/init_weight_group first")
    if group.expires is not None:
        group.expires.cancel()
    try:
        return BroadcastReceiver(request, store, group)
    except BaseException:
        group.abort()
        raise


def vote(pg: Any, value: int, device: torch.device, timeout: timedelta) -> int:
    """MIN all-reduce of one int32 over the group (the trainer's side calls it too)."""
    flag = torch.tensor([value], dtype=torch.int32, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp, opts.timeout = dist.ReduceOp.MIN, timeout
    pg.allreduce([flag], opts).wait(timeout)
    return int(flag.item())


def _vote(group: Group, value: int, timeout_s: float | None = None) -> int:
    return vote(group.pg, value, group.comm_device, timedelta(seconds=timeout_s or group.spec.timeout_s))


class BroadcastReceiver:
    name = "broadcast"

    def __init__(self, request: UpdateRequest, store: Any, group: Group) -> None:
        src = request.source
        self.request = request
        self.group = group
        self.live: dict[str, torch.Tensor] = store.params
        self._table = parse_table(src.get("table"))
        bucket = src.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
        if not isinstance(bucket, int) or isinstance(bucket, bool) or not 1 <= bucket <= 1 << 34:
            raise BadUpdateRequest("'bucket_bytes' must be an integer in [1, 16 GiB]")
        self.bucket_bytes = bucket
        keep_at = src.get("keep_at")
        if keep_at is not None and (not isinstance(keep_at, str) or not keep_at):
            raise BadUpdateRequest("'keep_at' must be a directory path")
        self.keep_at = keep_at
        deadline_s = src.get("deadline_s")  # the daemon's bound on the session's pause: time left
        if deadline_s is not None and (not isinstance(deadline_s, int | float) or isinstance(deadline_s, bool)
                                       or not 0 < deadline_s <= 3600):  # fmt: skip
            raise BadUpdateRequest("'deadline_s' must be a number in (0, 3600]")
        self._deadline = time.monotonic() + float(deadline_s or group.spec.timeout_s * 1e6)
        self._voted = False
        self._digest: str | None = None
        self._stats: dict[str, Any] = {"group": group.spec.group_name, "backend": group.spec.backend}

    # -- WorkerTransport --------------------------------------------------------------------
    def open(self) -> None:
        """The "ready" vote: 1 only if the table fits the live parameters (nothing is written)."""
        mine = 1
        try:
            check_table(self._table, self.live)
            expect = self.request.expect.tensors
            if expect is not None and expect != len(self._table):
                mine = 0
        except TableMismatch:
            mine = 0
        self._voted = True
        t0 = time.perf_counter()
        try:
            agreed = _vote(self.group, mine, self._left())
            self._stats["ready_vote_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as exc:
            raise TransportError(f"weight group {self.group.spec.group_name!r}: ready vote failed: {exc}") from None
        if mine and not agreed:
            raise TransportError("another member of the weight group refused the broadcast (its table did not "
                                 "match its parameters, or the trainer gave up); nothing was written")  # fmt: skip
        # mine == 0: the update path's own check_table refuses it with the reason

    def table(self) -> dict[str, TensorSpec]:
        return dict(self._table)

    def write_into(self, params: dict[str, torch.Tensor]) -> None:
        if not self._voted:
            self.open()
        g, t0 = self.group, time.perf_counter()
        flat = {n: params[n].detach().view(-1).view(torch.uint8) for n in self._table}
        size = min(self.bucket_bytes, max(1, total_bytes(self._table)))
        buf = torch.empty(size, dtype=torch.uint8, device=g.comm_device)
        hasher = stream_hasher(self._table)
        n = 0
        try:
            for used, pieces in buckets(self._table, self.bucket_bytes):
                view = buf[:used]
                bucket_broadcast(g.pg, view, timedelta(seconds=self._left()))
                host = view if view.device.type == "cpu" else view.cpu()
                hasher.update(memoryview(host.numpy()))
                for p in pieces:
                    flat[p.name][p.start : p.start + p.size].copy_(view[p.offset : p.offset + p.size])
                n += 1
        except Exception as exc:
            past = " (the session ran past the daemon's bound on its pause, [rollout] broadcast_max_pause_s)"
            raise TransportError(f"broadcast interrupted after {n} bucket(s): {exc}"
                                 + (past if time.monotonic() >= self._deadline - 0.5 else "")) from None  # fmt: skip
        finally:
            del buf
        recv_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        bad = [name for name, spec in self._table.items() if not _finite(params[name], spec.dtype)]
        if not bad and self.keep_at:
            try:
                keep_ms = self._keep(params)
            except Exception as exc:
                self._try_vote(0)
                raise TransportError(f"cannot save the received version to {self.keep_at}: {exc}") from None
            self._stats["keep_ms"] = keep_ms
        if bad:
            self._try_vote(0)
            raise TransportError(f"received non-finite values in {len(bad)} tensor(s), first {bad[0]!r}")
        checked_ms = (time.perf_counter() - t1) * 1e3
        t2 = time.perf_counter()
        try:
            _vote(g, 1, self._left())
        except Exception as exc:
            raise TransportError(f"broadcast did not finish (done vote): {exc}") from None
        self._digest = stream_digest(hasher)
        self._stats.update(buckets=n, received_bytes=total_bytes(self._table), receive_ms=recv_ms,
                           finite_ms=checked_ms, done_vote_ms=(time.perf_counter() - t2) * 1e3)  # fmt: skip

    def source_digest(self) -> str | None:
        """The digest of the bytes this worker received (None until they all arrived)."""
        return self._digest

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def close(self) -> None:
        if not self._voted:  # refused before the vote: tell the others, so nobody waits
            self._voted = True
            self._try_vote(0)
        self.group.abort()

    # -- details ----------------------------------------------------------------------------
    def _left(self) -> float:
        """The group's timeout, or less: what is left of the session's bound (raises once it is spent)."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TransportError("the broadcast session ran past the daemon's bound on its pause "
                                 "([rollout] broadcast_max_pause_s)")  # fmt: skip
        return min(self.group.spec.timeout_s, left)

    def _try_vote(self, value: int) -> None:
        with contextlib.suppress(Exception):
            _vote(self.group, value)

    def _keep(self, params: dict[str, torch.Tensor]) -> float:
        """Save the received tensors as a checkpoint directory (config and tokenizer from the model's)."""
        t0 = time.perf_counter()
        dest = Path(self.keep_at or "")
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model_dir = Path(self.group.model_dir)
        for f in model_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (MANIFEST_NAME, "model.safetensors.index.json"):
                shutil.copy2(f, tmp / f.name)
        save_file({n: params[n].detach().cpu().contiguous() for n in self._table}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "hotswap_version": self.request.version})  # fmt: skip
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
        return (time.perf_counter() - t0) * 1e3


# safetensors dtype -> (integer view, exponent mask, all-ones pattern that means Inf/NaN): the raw
# bits are checked, as daemon.checks.finite does, so bf16 needs no float conversion (and it is fast)
_NONFINITE: dict[str, tuple[torch.dtype, int, int]] = {
    "F64": (torch.int64, 0x7FF0000000000000, 0x7FF0000000000000),
    "F32": (torch.int32, 0x7F800000, 0x7F800000),
    "F16": (torch.int16, 0x7C00, 0x7C00),
    "BF16": (torch.int16, 0x7F80, 0x7F80),
    "F8_E5M2": (torch.uint8, 0x7C, 0x7C),
    "F8_E4M3": (torch.uint8, 0x7F, 0x7F),  # float8_e4m3fn: no Inf; NaN is S.1111.111
}


def _finite(t: torch.Tensor, dtype: str) -> bool:
    """No NaN or Inf in `t` (integer tensors always are)."""
    bits = _NONFINITE.get(dtype)
    if bits is None or t.numel() == 0:
        return True
    view, mask, bad = bits
    return not bool((t.detach().reshape(-1).view(view) & mask).eq_(bad).any())


def tensors_digest(table: dict[str, TensorSpec], tensors: dict[str, torch.Tensor]) -> str:
    """The digest a worker computes of the stream (`write_into`), from the sender's tensors: the
    table, then every tensor's bytes in table order (the bucket cut does not change the hash)."""
    hasher = stream_hasher(table)
    for name in table:
        t = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
        hasher.update(memoryview((t if t.device.type == "cpu" else t.cpu()).numpy()))
    return stream_digest(hasher)


def bucket_broadcast(pg: Any, tensor: torch.Tensor, timeout: timedelta) -> None:
    """One broadcast from rank 0 (the trainer) over `pg`, waited for at most `timeout`."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timeout
    pg.broadcast([tensor], opts).wait(timeout)
