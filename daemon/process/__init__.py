"""Process plumbing of the daemon around its pipeline: checks before start, and SIGHUP.

    preflight  what must hold before the daemon touches anything (token files, keys, ports)
    reload     SIGHUP: re-read the config, apply what can change live, say what needs a restart

Used by daemon.service only; imports config, the pipeline and sources, never the API or the CLI.
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.process.health import HealthMonitor, ProblemCollector, database_problems, health_document
    from daemon.process.preflight import port_error, preflight_problems, run_preflight
    from daemon.process.reload import Reloadable, ReloadResult, reload_config

__all__ = [
    "HealthMonitor", "ProblemCollector", "ReloadResult", "Reloadable", "database_problems",
    "health_document", "port_error", "preflight_problems", "reload_config", "run_preflight"
]

__getattr__ = public_face(__name__)
