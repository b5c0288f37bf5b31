"""The broadcast transport: a trainer pushes tensors straight into the workers' parameters over
torch.distributed (gloo on CPU, NCCL on GPUs); this module is the part both ends agree on, and
the daemon side. No torch here: the daemon imports it, the worker side is `broadcast_worker.py`.

Wire protocol of one session (rank 0 = the trainer, workers `rank_offset .. world_size-1`):

1. every worker validates the tensor table of its update request (`check_table`) and takes part
   in one MIN all-reduce of an int32 "ready" flag; the trainer contributes 1. A 0 anywhere means
   a table was refused: everyone stops before a byte of weights moves.
2. the tensors, in table order, form one byte stream; it is cut into buckets of `bucket_bytes`
   (`buckets(table, bucket_bytes)`) and each bucket is one broadcast from rank 0 (a tensor may
   span buckets). Workers copy each bucket into their parameters and hash the bytes they got.
3. every worker checks the received floating tensors are finite, then one MIN all-reduce of a
   "done" flag tells the trainer whether all of them took it.
Then everyone aborts the group (never a half-open communicator). The worker's digest of the
received bytes (`stream_digest`) is what the daemon records. With signing keys configured the
trainer also signs `session_message` (version, table, the digest it computed before sending) and
the daemon holds the workers' digest to that; the unsigned claim alone is never trusted.

Daemon side (`BroadcastSender`, the registry's daemon entry): a broadcast version never comes from
the rollout's own stager (the trainer drives it through a session, `daemon.controller.broadcast`), so when
`[rollout] transport = "broadcast"` the ordinary rollouts (a checkpoint from a folder, a rollback
to a version a worker saved to disk) go as disk updates.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from daemon.hashing import new_strong_hash
from daemon.manifest import canonical_bytes
from daemon.transport.base import (
    ST_TO_TORCH,
    BadUpdateRequest,
    Outgoing,
    Prepared,
    SenderOptions,
    StageError,
    TensorSpec,
    UpdateRequest,
)

DEFAULT_BUCKET_BYTES = 64 << 20
MAX_TENSORS = 1_000_000
DIGEST_ALG = "blake3"
_ITEM = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F16": 2,
         "BF16": 2, "F32": 4, "F64": 8, "F8_E5M2": 1, "F8_E4M3": 1}  # fmt: skip


class BroadcastSender:
    """Daemon side for the rollout stager: ordinary versions go to the workers from disk."""

    name = "broadcast"

    def __init__(self, options: SenderOptions) -> None:
        self.options = options

    def prepare(self, item: Outgoing) -> Prepared:
        if not item.local_path:
            raise StageError(f"{item.version}: no local copy to deploy from (broadcast versions come from the trainer)")
        return Prepared(UpdateRequest(item.version, "disk", {"path": item.local_path}, "copy", item.expect))

    def retain(self, versions: set[str]) -> None:
        return None

    def close(self) -> None:
        return None


# ------------------------------------------------------------------------------ the tensor table


def table_to_json(table: Mapping[str, TensorSpec]) -> list[dict[str, Any]]:
    return [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in table.values()]


def parse_table(doc: Any) -> dict[str, TensorSpec]:
    """A table `[{name, dtype, shape}, ...]` (order kept: it is the order of the byte stream)."""
    if not isinstance(doc, list) or not doc:
        raise BadUpdateRequest("broadcast 'table' must be a non-empty list of {name, dtype, shape}")
    if len(doc) > MAX_TENSORS:
        raise BadUpdateRequest(f"broadcast 'table' has {len(doc)} tensors (at most {MAX_TENSORS})")
    out: dict[str, TensorSpec] = {}
    for i, e in enumerate(doc):
        if not isinstance(e, dict):
            raise BadUpdateRequest(f"table[{i}] must be an object {{name, dtype, shape}}")
        name, dtype, shape = e.get("name"), e.get("dtype"), e.get("shape")
        if not isinstance(name, str) or not name:
            raise BadUpdateRequest(f"table[{i}].name must be a non-empty string")
        if dtype not in ST_TO_TORCH:
            raise BadUpdateRequest(f"table[{i}] ({name}): unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):  # fmt: skip
            raise BadUpdateRequest(f"table[{i}] ({name}): shape must be a list of non-negative integers")
        if name in out:
            raise BadUpdateRequest(f"table[{i}]: tensor {name!r} is listed twice")
        out[name] = TensorSpec(name, dtype, tuple(shape), math.prod(shape) * _ITEM[dtype])
    return out


def total_bytes(table: Mapping[str, TensorSpec]) -> int:
    return sum(s.nbytes for s in table.values())


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [start, start+size) of tensor `name` sit at `offset` of a bucket."""

    name: str
    start: int
    size: int
    offset: int


def buckets(table: Mapping[str, TensorSpec], bucket_bytes: int) -> Iterator[tuple[int, list[Piece]]]:
    """(bucket size, pieces) in stream order; both ends compute the same cut from the table alone."""
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be positive")
    pieces: list[Piece] = []
    used = 0
    for spec in table.values():
        start = 0
        while start < spec.nbytes:
            take = min(spec.nbytes - start, bucket_bytes - used)
            pieces.append(Piece(spec.name, start, take, used))
            used += take
            start += take
            if used == bucket_bytes:
                yield used, pieces
                pieces, used = [], 0
    if pieces:
        yield used, pieces


def stream_hasher(table: Mapping[str, TensorSpec]) -> Any:
    """A hasher primed with the table (names, dtypes, shapes): feed it the stream's bytes."""
    h = new_strong_hash(DIGEST_ALG)
    h.update(json.dumps(table_to_json(table), separators=(",", ":")).encode() + b"\n")
    return h


def stream_digest(hasher: Any) -> str:
    return f"broadcast-{DIGEST_ALG}:{hasher.hexdigest()}"


def session_message(version: str, table: Mapping[str, TensorSpec], digest: str) -> bytes:
    """What a signed session's signature covers: the canonical JSON of the version, the table
    (names, dtypes, shapes, in stream order) and the content digest the workers will compute
    (`stream_digest`); signed and verified by daemon.checks.signatures, as manifests are."""
    return canonical_bytes({"kind": "hotswap-broadcast", "version": version, "table": table_to_json(table),
                            "digest": digest})  # fmt: skip
