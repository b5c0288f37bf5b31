"""A uvicorn server on a guarded protocol (daemon.common.httpguard) in a thread, for the listener tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI, Request

from daemon.common.httpguard import ListenerLimits, guarded_protocol
from daemon.common.tcplisten import tcp_listener

# set by /stall once the server's event loop is blocked (a test queues connections meanwhile)
stalled = threading.Event()


@contextmanager
def serving(limits: ListenerLimits) -> Iterator[tuple[uvicorn.Server, threading.Thread, int]]:
    """A uvicorn server on a guarded protocol in a thread: (server, thread, port)."""
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/stall")
    async def stall(s: float) -> dict[str, bool]:
        stalled.set()
        time.sleep(s)  # blocks the event loop on purpose: connections queue up unaccepted
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    sock = tcp_listener("127.0.0.1", 0)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                            http=guarded_protocol(limits, "test"))  # fmt: skip
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield srv, t, sock.getsockname()[1]
    finally:
        srv.should_exit = True
        t.join(timeout=30)
        sock.close()
