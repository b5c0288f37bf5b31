"""A real Prometheus server on loopback for the gate tests: Debian's `prometheus` binary, extracted
into a cache by scripts/check-metrics.sh --server (no root install), scraping the targets given
once a second with a generated config; each target carries the labels it is given (`host`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
from support_wait import wait_until

REPO = Path(__file__).resolve().parents[1]


def prometheus_binary() -> str | None:
    """The server binary's path, extracted on first use; None when it cannot be had here."""
    if shutil.which("apt-get") is None and shutil.which("prometheus") is None:
        return None
    r = subprocess.run([str(REPO / "scripts" / "check-metrics.sh"), "--server"], capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None


class PrometheusServer:
    def __init__(self, binary: str, root: Path, port: int) -> None:
        self.binary, self.root, self.port = binary, root, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, targets: list[tuple[str, dict[str, str]]]) -> PrometheusServer:
        """`targets`: (base URL, labels) of each /metrics to scrape."""
        self.root.mkdir(parents=True, exist_ok=True)
        lines = ["global:", "  scrape_interval: 1s", "  scrape_timeout: 1s", "scrape_configs:",
                 "  - job_name: hotswap", "    static_configs:"]  # fmt: skip
        for url, labels in targets:
            hostport = url.split("://", 1)[1].rstrip("/")
            lines += [f"      - targets: ['{hostport}']", "        labels:"]
            lines += [f"          {k}: '{v}'" for k, v in labels.items()]
        (self.root / "prometheus.yml").write_text("\n".join(lines) + "\n")
        log = open(self.root / "prometheus.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.root / 'prometheus.yml'}", f"--storage.tsdb.path={self.root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        log.close()
        wait_until(self._ready, 60, 0.1, "Prometheus ready")
        n = len(targets)
        wait_until(lambda: len(self.query("up == 1")) == n, 60, 0.2, f"Prometheus scraping all {n} targets")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log()[-3000:]
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, q: str) -> list[Any]:
        doc = httpx.get(f"{self.url}/api/v1/query", params={"query": q}, timeout=5).json()
        assert doc["status"] == "success", doc
        return list(doc["data"]["result"])

    def log(self) -> str:
        p = self.root / "prometheus.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
