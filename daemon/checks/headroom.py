"""Check "headroom": enough host RAM (and GPU memory when IPC staging is on) to stage.

Failing here defers the checkpoint instead of rejecting it: the coordinator retries
once memory frees up.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import psutil

from daemon.checks.base import CheckContext, CheckFailed
from daemon.checks.headers import load_table

SHM = Path("/dev/shm")
GIB = 1024**3


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def check_headroom(ctx: CheckContext) -> dict[str, Any]:
    table = load_table(ctx)
    stage_bytes = sum(loc.entry.nbytes for loc in table.values())
    factor = ctx.settings.headroom_factor
    need = int(stage_bytes * factor)
    # the crc32c pass's staged copy is freed when verify ends, before anything stages for workers
    staged = ctx.staged
    staged_host = staged.nbytes if staged is not None and staged.device == "cpu" else 0
    available = psutil.virtual_memory().available + staged_host
    detail: dict[str, Any] = {
        "stage_bytes": stage_bytes,
        "factor": factor,
        "host_needed": need,
        "host_available": available,
    }
    if staged is not None:
        detail["counted_staged_copy"] = {"device": staged.device, "bytes": staged.nbytes}
    if available < need:
        raise CheckFailed(
            f"host RAM available {_gib(available)} < {factor} x {_gib(stage_bytes)} to stage "
            f"({_gib(need)}); deferred until memory frees",
            detail,
            deferred=True,
        )
    if ctx.settings.ipc_enabled:
        same_gpu = staged is not None and staged.device not in ("cpu",) and _same_device(staged.device, ctx.settings.staging_gpu)
        detail.update(_gpu_headroom(ctx.settings.staging_gpu, stage_bytes, staged.nbytes if same_gpu and staged else 0))
    return detail


def _same_device(a: str, b: str) -> bool:
    return a == b or {a, b} <= {"cuda", "cuda:0"}


def _gpu_headroom(device: str, stage_bytes: int, staged_here: int = 0) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        # without a GPU the IPC protocol runs over shared host memory (/dev/shm)
        if SHM.is_dir():
            free = shutil.disk_usage(SHM).free
            if free < stage_bytes:
                raise CheckFailed(
                    f"{SHM} free {_gib(free)} < {_gib(stage_bytes)} to stage over host shared memory; "
                    "deferred until space frees",
                    {"shm_free": free, "stage_bytes": stage_bytes},
                    deferred=True,
                )
            return {"shm_free": free}
        return {"gpu": "no CUDA device and no /dev/shm"}
    free, total = torch.cuda.mem_get_info(torch.device(device))
    free += staged_here
    if free < stage_bytes:
        raise CheckFailed(
            f"GPU {device} free memory {_gib(free)} < {_gib(stage_bytes)} to stage; deferred until it frees",
            {"gpu": device, "gpu_free": free, "gpu_total": total, "stage_bytes": stage_bytes},
            deferred=True,
        )
    return {"gpu": device, "gpu_free": free, "gpu_total": total}
