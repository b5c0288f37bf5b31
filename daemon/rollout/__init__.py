"""Rollout: the worker state machine, rolling updates, rollback, health window and crash recovery.

Modules, in the order the data flows: settings (config sections) -> planner
(batches) -> stage (update requests per transport) -> driver (one worker through
the state machine) -> engine (the fleet, and the failure path) -> health (the
post-deploy window) -> recovery (after a daemon crash) -> service (the runner
thread, queue and operator commands) -> api_routes / control (HTTP and CLI).
Kept import-free so `daemon.config` can load the settings cheaply.
"""
