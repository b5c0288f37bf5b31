"""From a discovered checkpoint to a verdict: register -> fetch -> verify, then hand it on.

    coordinator  one thread takes each discovered checkpoint through registration, fetch (for
                 remote sources) and the checks, records the verdict (the one writer of
                 checkpoint status is daemon.registry.status) and tells the controller
    rediscovery  a checkpoint seen again: unchanged, changed (re-verify or record it), a conflict

Imports sources, checks and the registry; never the controller, the API or the CLI: what
happens to a verified version is the controller's business (daemon.controller).
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.pipeline import deltas
    from daemon.pipeline.coordinator import Coordinator, StatusObserver
    from daemon.pipeline.rediscovery import OPERATOR_REVERIFY, changed_since_verdict, request_reverify

__all__ = [
    "Coordinator", "OPERATOR_REVERIFY", "StatusObserver", "changed_since_verdict", "deltas",
    "request_reverify"
]

__getattr__ = public_face(__name__)
