"""The verify stage: prove a checkpoint whole and sane before any worker sees it.

`run_checks(directory, settings, reference=..., on_result=...)` runs, cheap to dear,
"manifest", "headers", "crc32c", "compat", "finite", "headroom", "forward" and stops
at the first failure (docs/concepts/pipeline.md "Checks"). A LoRA adapter checkpoint (PEFT layout) runs the
same list with "compat" and "forward" against the serving base (daemon.checks.adapter).
"headers", "compat" and "forward", whose cost the checkpoint sets, run in a child process under
`check_time_limit_s` (daemon.checks.isolation; the table of check functions: daemon.checks.lookup).
"""

from typing import TYPE_CHECKING

from daemon import public_face
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

if TYPE_CHECKING:
    from daemon.checks.base import REQUIRES, VerifyStager, dependency_problem
    from daemon.checks.compat import has_tokenizer
    from daemon.checks.isolation import CHECK_PROCESS, FORWARD_IMPORTS
    from daemon.checks.signatures import (
        HmacSigner,
        SignatureError,
        load_signer,
        read_ed25519_private,
        read_ed25519_public,
        read_hmac_key,
        verify_manifest_signature,
        verify_signature,
    )

__all__ = [
    "CHECK_NAMES", "CHECK_PROCESS", "CheckContext", "CheckFailed", "CheckResult", "CheckSettings",
    "CheckSkipped", "FORWARD_IMPORTS", "HmacSigner", "REQUIRES", "SignatureError", "VerifyReport",
    "VerifyStager", "dependency_problem", "has_tokenizer", "load_signer", "read_ed25519_private",
    "read_ed25519_public", "read_hmac_key", "run_checks", "verify_manifest_signature", "verify_signature"
]

__getattr__ = public_face(__name__)
