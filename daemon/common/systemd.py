"""sd_notify without a dependency: READY=1, STATUS=..., WATCHDOG=1, STOPPING=1.

systemd passes a datagram socket in $NOTIFY_SOCKET (a path, or "@name" for the
abstract namespace). Outside systemd every call is a cheap no-op.
"""

from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send one sd_notify message; True when a notify socket exists and took it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode("utf-8"))
        return True
    except OSError:
        return False


def ready(status: str | None = None) -> bool:
    return notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def status(text: str) -> bool:
    return notify(f"STATUS={text}")


def stopping() -> bool:
    return notify("STOPPING=1")


def watchdog_ping() -> bool:
    return notify("WATCHDOG=1")


def watchdog_interval_s() -> float | None:
    """Half the watchdog timeout systemd set for this process (ping at least that often), else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.5, int(usec) / 1e6 / 2)
    except ValueError:
        return None
