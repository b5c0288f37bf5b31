"""Helpers for worker tests: real `python -m daemon.worker.server` processes on tiny checkpoints."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
TOKEN = "worker-test-token-7f3a"
# the device test workers run on; cpu here, cuda:0 when the suite is run on a GPU machine
DEVICE = os.environ.get("HOTSWAP_TEST_WORKER_DEVICE", "cpu")


def write_byte_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer with exactly 256 tokens (the tiny model's vocabulary), no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(str(directory))


def write_token(directory: Path, token: str = TOKEN) -> Path:
    p = directory / "token"
    p.write_text(token + "\n")
    p.chmod(0o600)
    return p


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@dataclass
class WorkerProcess:
    """One running worker; `url` is http://host:port or unix:/path."""

    proc: subprocess.Popen[str]
    url: str
    token: str
    lines: list[str] = field(default_factory=list)

    @property
    def client(self) -> httpx.Client:
        if self.url.startswith("unix:"):
            return httpx.Client(transport=httpx.HTTPTransport(uds=self.url[5:]), base_url="http://w", timeout=60)
        return httpx.Client(base_url=self.url, timeout=60)

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        with self.client as c:
            return c.get(path, **kw)

    def post(self, path: str, body: Any = None, *, admin: bool = False, **kw: Any) -> httpx.Response:
        headers = kw.pop("headers", {})
        if admin:
            headers = {**self.auth(), **headers}
        with self.client as c:
            return c.post(path, json=body if body is not None else {}, headers=headers, **kw)

    def admin(self, path: str, body: Any = None) -> dict[str, Any]:
        r = self.post(path, body, admin=True)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
        return r.json()

    def info(self) -> dict[str, Any]:
        r = self.get("/weight_info", headers=self.auth())
        assert r.status_code == 200, r.text
        return r.json()

    def greedy(self, prompt: list[int] | str, max_tokens: int = 12) -> list[int]:
        r = self.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                          "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def start_worker(
    model: Path,
    token_file: Path | None,
    *,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 90.0,
    module: str = "daemon.worker.server",
) -> WorkerProcess:
    """Start a worker on port 0 (or --uds in `extra`) and wait for its ready line.

    `module`: the entry point (tests.hooked_worker adds test hooks)."""
    cmd = [sys.executable, "-m", module, "--model", str(model), "--port", "0",
           "--device", DEVICE, "--log-level", "warning"]
    if token_file is not None:
        cmd += ["--token-file", str(token_file)]
    cmd += extra or []
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            cwd=str(REPO))
    lines: list[str] = []
    found: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("hotswap worker ready:"):
                found.put(line)
        found.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        line = found.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        raise RuntimeError("worker did not become ready:\n" + "\n".join(lines)) from None
    if line is None:
        raise RuntimeError(f"worker exited with {proc.wait()}:\n" + "\n".join(lines))
    url = line.split("url=", 1)[1].split()[0]
    token = token_file.read_text().strip() if token_file else ""
    return WorkerProcess(proc, url, token, lines)


def stream_in_thread(w: WorkerProcess, body: dict[str, Any]) -> tuple[threading.Thread, list[dict[str, Any]], dict[str, Any]]:
    """POST a streaming completion in a thread; chunks arrive in the returned list as they come."""
    chunks: list[dict[str, Any]] = []
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            with w.client as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                outcome["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
                    elif line == "data: [DONE]":
                        outcome["done"] = True
        except Exception as exc:  # surfaced by the test's assertions
            outcome["error"] = repr(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, chunks, outcome


