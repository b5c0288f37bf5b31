"""The daemon's HTTP API: one FastAPI app on the control listener.

    app               the app, status and metrics routes, the listener (ApiServer), rollout
                      control routes (`/v1/rollout/...`)
    broadcast         `POST /v1/broadcast...`: a trainer's torch.distributed session, parsed and
                      authenticated here, driven by daemon.controller.broadcast
    readiness         `/ready`: does this host serve
    reverify          `POST /v1/checkpoints/reverify`
    registry_metrics  the Prometheus series read from the registry at scrape time

Above the pipeline and the controller (it calls into both); below `daemon.service`, which builds
it. The push source's listener is a source (daemon.sources.push), not part of this app.
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.api import reverify
    from daemon.api.app import ApiServer, ApiState, create_app, rollout_router, status_document
    from daemon.api.broadcast import broadcast_router
    from daemon.api.control_routes import fleet_router, whoami_router
    from daemon.api.readiness import readiness_router
    from daemon.api.registry_metrics import RegistryCollector, RolloutMetrics, version_bytes

__all__ = [
    "ApiServer", "ApiState", "RegistryCollector", "RolloutMetrics", "broadcast_router", "create_app",
    "fleet_router", "readiness_router", "reverify", "rollout_router", "status_document", "version_bytes",
    "whoami_router"
]

__getattr__ = public_face(__name__)
