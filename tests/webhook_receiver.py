"""A webhook receiver as its own process, for the webhook tests: `python webhook_receiver.py DIR`.

Writes its port to DIR/port; each POST appends one JSON line to DIR/received.jsonl (delivery id,
event header, signature header, the body as text, the status it answered). It answers 500 while
DIR/fail exists, 200 otherwise; while DIR/slow exists it holds each request open (after noting it
in DIR/started.jsonl) until the file is removed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(sys.argv[1])
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if (ROOT / "slow").exists():
            with LOCK, open(ROOT / "started.jsonl", "a") as f:
                f.write(json.dumps({"delivery": self.headers.get("Hotswap-Delivery")}) + "\n")
            deadline = time.monotonic() + 120
            while (ROOT / "slow").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        status = 500 if (ROOT / "fail").exists() else 200
        line = {"delivery": self.headers.get("Hotswap-Delivery"), "event": self.headers.get("Hotswap-Event"),
                "signature": self.headers.get("Hotswap-Signature"), "body": body.decode(), "status": status}
        with LOCK, open(ROOT / "received.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok" if status == 200 else b"no")

    def log_message(self, *_args: object) -> None:
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    (ROOT / "port.tmp").write_text(str(server.server_address[1]))
    (ROOT / "port.tmp").rename(ROOT / "port")
    server.serve_forever()
