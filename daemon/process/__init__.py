"""Process plumbing of the daemon around its pipeline: checks before start, and SIGHUP.

    preflight  what must hold before the daemon touches anything (token files, keys, ports)
    reload     SIGHUP: re-read the config, apply what can change live, say what needs a restart

Used by daemon.service only; imports config, the pipeline and sources, never the API or the CLI.
"""
