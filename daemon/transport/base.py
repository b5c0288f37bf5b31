"""The small interface every weight transport implements (httpx-style transports).

A transport is opened on a source (a checkpoint directory, an IPC descriptor, a
process group), reports the full tensor table *before* anything is written, and
then writes into parameters that already exist. The worker validates the table
against its live parameters with `check_table` first, so a mismatch is refused
before a single parameter changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

# safetensors dtype string <-> torch dtype name
ST_TO_TORCH: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
}
TORCH_TO_ST: dict[str, str] = {v: k for k, v in ST_TO_TORCH.items()}


class TableMismatch(ValueError):
    """The incoming tensor table does not match the live parameters; nothing was written."""


class TransportError(RuntimeError):
    """The transport failed while writing; the caller must restore the previous weights."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class WeightTransport(Protocol):
    name: str

    def table(self) -> dict[str, TensorSpec]:
        """Every tensor the source will deliver; reads headers/descriptors only."""
        ...

    def write_into(self, params: dict[str, torch.Tensor]) -> None:
        """Copy every tensor into the existing storage of `params` (same keys as table())."""
        ...

    def close(self) -> None: ...


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    dtype = TORCH_TO_ST[str(t.dtype).removeprefix("torch.")]
    return TensorSpec(name, dtype, tuple(t.shape), t.numel() * t.element_size())


def check_table(incoming: dict[str, TensorSpec], params: dict[str, torch.Tensor], limit: int = 5) -> None:
    """Raise TableMismatch listing the first differences between a source and live parameters."""
    problems: list[str] = []
    missing = sorted(set(params) - set(incoming))
    unexpected = sorted(set(incoming) - set(params))
    problems += [f"missing tensor {n!r}" for n in missing[:limit]]
    problems += [f"unexpected tensor {n!r}" for n in unexpected[:limit]]
    for name in sorted(set(params) & set(incoming)):
        want, got = spec_of(name, params[name]), incoming[name]
        if want.shape != got.shape:
            problems.append(f"tensor {name!r}: shape {list(got.shape)} != live {list(want.shape)}")
        elif want.dtype != got.dtype:
            problems.append(f"tensor {name!r}: dtype {got.dtype} != live {want.dtype}")
        elif want.nbytes != got.nbytes:
            problems.append(f"tensor {name!r}: {got.nbytes} bytes != live {want.nbytes}")
        if len(problems) >= limit:
            break
    if problems:
        extra = len(missing) + len(unexpected)
        raise TableMismatch("; ".join(problems[:limit]) + (f" (+{extra} more)" if extra > limit else ""))
