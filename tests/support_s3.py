"""A real moto S3 (and SQS) server as a subprocess on loopback, and plain boto3 clients for it.

    server = MotoServer().start()     # random free port on 127.0.0.1
    s3 = server.client()              # plain boto3 against it
    server.stop(); server.start()     # same port again (moto's state is lost: upload again)

`serve_moto(monkeypatch)`: the body of a per-test fixture (credentials in the environment, one
running server, stopped at teardown).
"""

from __future__ import annotations

import base64
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import crc32c
import pytest
from support_wait import free_port  # noqa: F401 - used and re-exported

CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing-secret", "region_name": "us-east-1"}


class MotoServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> MotoServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on port {self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self, service: str = "s3") -> Any:
        return boto3.client(service, endpoint_url=self.url, **CREDS)

    def env(self) -> dict[str, str]:
        """Credentials for a daemon subprocess (boto3's environment chain)."""
        return {"AWS_ACCESS_KEY_ID": CREDS["aws_access_key_id"],
                "AWS_SECRET_ACCESS_KEY": CREDS["aws_secret_access_key"],
                "AWS_DEFAULT_REGION": CREDS["region_name"]}  # fmt: skip


def serve_moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """The body of a `moto_server` fixture: `yield from serve_moto(monkeypatch)`."""
    for k, v in MotoServer().env().items():
        monkeypatch.setenv(k, v)
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.stop()


def b64crc(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def put_file(s3: Any, bucket: str, key: str, path: Path) -> None:
    s3.put_object(Bucket=bucket, Key=key, Body=path.read_bytes(), ChecksumAlgorithm="CRC32C")


def put_multipart(s3: Any, bucket: str, key: str, path: Path, part: int = 5 * 1024 * 1024,
                  full_object: bool = True) -> None:  # fmt: skip
    """A multipart upload with per-part CRC32C and, with `full_object`, the FULL_OBJECT CRC32C."""
    data = path.read_bytes()
    extra = {"ChecksumType": "FULL_OBJECT"} if full_object else {}
    up = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C", **extra)
    parts = []
    for i in range(0, len(data), part):
        n = i // part + 1
        r = s3.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=n, Body=data[i:i + part],
                           ChecksumAlgorithm="CRC32C")  # fmt: skip
        parts.append({"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32C": r["ChecksumCRC32C"]})
    done = {"ChecksumCRC32C": b64crc(data), **extra} if full_object else {}
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts},
                                 **done)  # fmt: skip


def upload_dir(s3: Any, bucket: str, prefix: str, directory: Path, *, manifest_first: bool = False) -> list[str]:
    """Upload every file of `directory` under `prefix`; returns the keys in upload order."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    files.sort(key=lambda p: (p.name != "hotswap-manifest.json") if manifest_first else 0)
    keys = []
    for p in files:
        key = prefix + p.relative_to(directory).as_posix()
        put_file(s3, bucket, key, p)
        keys.append(key)
    return keys


def random_file(path: Path, size: int, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        rnd = random.Random(seed)
        left = size
        while left:
            n = min(left, 1 << 20)
            f.write(rnd.randbytes(n))
            left -= n
    return path
