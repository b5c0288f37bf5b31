"""Generators for the docs site (mkdocs.yml runs them from `hooks.py` at build time).

Every generated page is built from the code itself, so it cannot drift from it:

    config_ref   every config key with type, default and description, from the config dataclasses
    cli_ref      every `hotswap` command's --help, from its argument parser
    http_ref     the HTTP routes of the daemon, its push listener and the worker, from their FastAPI apps
    diagrams     the checkpoint-status and worker-state diagrams (inline SVG) from the transition
                 tables in daemon.registry.status and daemon.rollout.states, and the process diagram
"""
