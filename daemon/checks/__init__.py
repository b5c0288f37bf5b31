"""The verify stage: prove a checkpoint whole and sane before any worker sees it.

`run_checks(directory, settings, reference=..., on_result=...)` runs, cheap to dear,
"manifest", "headers", "crc32c", "compat", "finite", "headroom", "forward" and stops
at the first failure (docs/concepts/pipeline.md "Checks"). A LoRA adapter checkpoint (PEFT layout) runs the
same list with "compat" and "forward" against the serving base (daemon.checks.adapter).
"headers", "compat" and "forward", whose cost the checkpoint sets, run in a child process under
`check_time_limit_s` (daemon.checks.isolation; the table of check functions: daemon.checks.lookup).
"""

from daemon.checks.base import (
    CHECK_NAMES,
    CheckContext,
    CheckFailed,
    CheckResult,
    CheckSettings,
    CheckSkipped,
    VerifyReport,
)
from daemon.checks.runner import run_checks

__all__ = [
    "CHECK_NAMES",
    "CheckContext",
    "CheckFailed",
    "CheckResult",
    "CheckSettings",
    "CheckSkipped",
    "VerifyReport",
    "run_checks",
]
