"""What kind of checkpoint a verified (or rejected) version is, recorded on its row: a LoRA adapter
(PEFT layout) with its name and base, or a full model."""

from __future__ import annotations

from pathlib import Path

from daemon.checks import VerifyReport
from daemon.formats import AdapterLayoutError, identity, is_adapter
from daemon.registry import Checkpoint


def record_kind(ckpt: Checkpoint, report: VerifyReport) -> None:
    """A LoRA adapter (PEFT layout) is recorded with its name and base, rejected or not, so
    `hotswap history --adapter NAME` shows every version that came in under that name."""
    directory = Path(ckpt.local_path or "")
    if not ckpt.local_path or not is_adapter(directory):
        return
    ckpt.kind = "adapter"
    try:
        ckpt.adapter_name, ckpt.base_model = identity(directory, ckpt.version, report.manifest.extra if report.manifest else None)
    except (AdapterLayoutError, ValueError):  # the compat check said why, in the status message
        ckpt.adapter_name = None
