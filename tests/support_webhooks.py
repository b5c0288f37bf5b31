"""The webhook tests' receiver process (tests/webhook_receiver.py) and checks of what it got."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from support_wait import wait_until

from daemon.webhooks.signing import verify

SECRET = "whsec-0123456789abcdef"


class Receiver:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "webhook_receiver.py"), str(root)])
        self.url = f"http://127.0.0.1:{wait_until(lambda: (root / 'port').exists() and (root / 'port').read_text(), 20)}/hook"

    def failing(self, on: bool) -> None:
        (self.root / "fail").touch() if on else (self.root / "fail").unlink(missing_ok=True)

    def lines(self) -> list[dict[str, Any]]:
        path = self.root / "received.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def accepted(self) -> list[dict[str, Any]]:
        return [x for x in self.lines() if x["status"] == 200]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def receiving(tmp_path: Path) -> Iterator[Receiver]:
    """A receiver process for a test's fixture (`yield from receiving(tmp_path)`), killed after it."""
    r = Receiver(tmp_path / "receiver")
    yield r
    r.close()


def hook(name: str, url: str, secret_file: Path, **kw: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "secret_file": str(secret_file), "timeout_s": 5.0,
            "retry_initial_s": 0.2, "retry_max_s": 1.0, **kw}  # fmt: skip


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "webhook.secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def verified(r: Receiver) -> list[str]:
    return [json.loads(x["body"])["version"] for x in r.accepted() if x["event"] == "version.verified"]


def check_deliveries(r: Receiver) -> list[dict[str, Any]]:
    """Every accepted delivery signed, under one id each, in event order per version; the payloads."""
    accepted = r.accepted()
    for x in accepted:
        assert verify(SECRET.encode(), x["body"].encode(), x["signature"]), x
    payloads = [json.loads(x["body"]) for x in accepted]
    ids = [p["id"] for p in payloads]
    assert ids == [x["delivery"] for x in accepted]
    assert len(set(ids)) == len(ids), f"a delivery id accepted twice: {ids}"
    assert len({p["event_id"] for p in payloads}) == len(payloads), "one event under two delivery ids"
    for version in {p["version"] for p in payloads}:
        seen = [p["event_id"] for p in payloads if p["version"] == version]
        assert seen == sorted(seen), f"{version}: out of order {seen}"
    return payloads
