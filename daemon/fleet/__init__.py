"""Many hosts on one PostgreSQL registry: the bound on hosts updating at once, the target a
fleet converges to, and each host's copy of a version.

    settings  `[fleet]`: typed and validated (a section of daemon.config)
    lease     `fleet_leases` slots taken with SELECT ... FOR UPDATE SKIP LOCKED, renewed, released
    target    the fleet target: an operator's, else the newest version some host had as last_good
    agent     per host: converge to the target under a lease (the controller's fleet job)
    behind    why this host is not on the target: its host_behind warning, its fleet_host_reasons row
    fetch     a version registered by another host: this host's copy through its own source
    stages    staged rollouts: which stage admits which host, decided by whichever host locks it
    trust     the decision lock (a row lock), who decided each admission and target, signed and verified

Above rollout (an agent drives daemon.rollout.engine); below the controller, which runs the agent.
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.fleet.agent import FleetAgent, holding, leased
    from daemon.fleet.fetch import fetch_here
    from daemon.fleet.lease import FleetLeases
    from daemon.fleet.settings import FleetSettings, fleet_problem
    from daemon.fleet.stages import StageCommandRefused, command, stage_gates, stage_label, status
    from daemon.fleet.target import TargetRefused, fleet_rows, fleet_target, set_fleet_target
    from daemon.fleet.trust import Trust

__all__ = [
    "FleetAgent", "FleetLeases", "FleetSettings", "StageCommandRefused", "TargetRefused", "Trust",
    "command", "fetch_here", "fleet_problem", "fleet_rows", "fleet_target", "holding", "leased",
    "set_fleet_target", "stage_gates", "stage_label", "status"
]

__getattr__ = public_face(__name__)
