"""A port squatter, run as its own process: another local user's server on a worker's port.

    python tests/support_squatter.py PORT LOG [--armed]

Binds 127.0.0.1:PORT (failing at once if it cannot), prints `squatting PORT`, then answers every
request like a healthy worker would (a RUNNING /weight_info on version v0, 200 for everything
else, a made-up proof for /admin/identify) and appends one JSON line per request to LOG: method,
path, headers and body. The tests read LOG to see what the daemon sent it.

`--armed`: started (interpreter and imports) before the port is free, it prints `armed`, waits
for a line on stdin, then binds as soon as the port is released (retrying for up to 5 s): what a
squatter waiting for a worker to die does, ahead of any relaunch.
"""

from __future__ import annotations

import errno
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAKE_INFO = {"version": "v0", "digest": None, "state": "RUNNING", "in_flight": 0, "tensors": 1, "bytes": 1,
             "device": "cpu", "update_count": 0, "requests_total": 0, "requests_failed": 0}  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    log_path = ""

    def _record(self) -> bytes:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(min(n, 1 << 20)) if n else b""
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"method": self.command, "path": self.path, "headers": dict(self.headers.items()),
                                "body": body.decode(errors="replace")}) + "\n")  # fmt: skip
        return body

    def _answer(self, doc: Any) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        self._answer(FAKE_INFO if self.path.startswith("/weight_info") else {"status": "ok", "state": "RUNNING"})

    def do_POST(self) -> None:  # noqa: N802
        self._record()
        if self.path == "/admin/identify":
            self._answer({"proof": "0" * 64})
        else:
            self._answer({"state": "RUNNING", "version": "v0", "weight_version": "v0", "finite": True})

    def log_message(self, format: str, *args: Any) -> None:
        return None


def main() -> None:
    port, log_path = int(sys.argv[1]), sys.argv[2]
    Handler.log_path = log_path
    if "--armed" in sys.argv[3:]:
        print("armed", flush=True)
        sys.stdin.readline()
        deadline = time.monotonic() + 5.0
        while True:
            try:
                server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.002)
    else:
        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"squatting {port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
