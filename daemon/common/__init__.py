"""Leaves every layer may use: process-level building blocks that know nothing of checkpoints.

    logging     structlog setup (JSON under systemd, console on a terminal), `get_logger`
    metrics     the daemon's Prometheus metric objects
    auth        bearer tokens: token files, `ControlGuard`
    jsonbody    bounded JSON request bodies
    apiconfig   listener settings (address, TLS) and the client side of TLS
    tcplisten   TCP listening sockets (TCP_NODELAY, reuse rules)
    identity    per-launch worker secrets and the private socket folder
    statelock   one daemon per state directory (flock)
    private     the state directory's modes: folders 0700, files 0600, whatever the umask
    systemd     sd_notify: READY, STATUS, WATCHDOG
    backoff     doubling delays with a reset
    redact      secrets out of URLs and documents before they are shown

Architecture invariant: imports nothing of the daemon's outside this package (leaf layer).
"""
