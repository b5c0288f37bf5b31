"""A TCP listening socket for our uvicorn servers (daemon API, push source, worker).

We bind up front (so port 0 works and a busy port is one clear error) and hand the socket to
uvicorn. asyncio sets TCP_NODELAY only on sockets whose `proto` is IPPROTO_TCP, and a socket
made as `socket(AF_INET, SOCK_STREAM)` reports proto 0, so connections accepted from it kept
Nagle on: every response's second write waited for the client's delayed ACK, ~40 ms per HTTP
call (measured on the reference worker: 44 ms per /health, /weight_info, /admin/pause). Linux
copies TCP_NODELAY from the listener to each accepted socket; proto is set too so asyncio agrees.
"""

from __future__ import annotations

import socket


def tcp_listener(host: str, port: int) -> socket.socket:
    """Bound (not listening yet) TCP socket on host:port, SO_REUSEADDR and TCP_NODELAY set.
    Raises OSError from bind (the caller words it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
