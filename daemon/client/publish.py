"""The trainer side of the S3 and push sources: hand a finished checkpoint directory to the daemon.

    publish_s3(directory, "s3://bucket/prefix/version")      files first, the manifest last
    push(directory, "https://host:8781", token, key)          streamed PUTs, then the signed commit

`publish_delta` (daemon.delta.build) writes a delta checkpoint against a base into a new folder.
Both write (or reuse) `hotswap-manifest.json` (daemon.manifest.publish: CRC32C + BLAKE3 per file).
`publish_s3` uploads files in parallel (multipart with CRC32C part checksums and the file's
FULL_OBJECT CRC32C from the manifest, so S3 itself refuses bytes that differ), then the manifest:
the S3 source commits a version only once every listed object is there anyway, so a crash
mid-upload leaves nothing that looks committed. `push` streams each file (never whole in memory)
with a progress bar on a TTY, retries a failed file, and commits with the manifest signed by
`key` (HMAC-SHA256); the daemon recomputes every digest from the bytes it received.
"""

from __future__ import annotations

import base64
import os
import ssl
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import boto3
import httpx
from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

from daemon.checks import HmacSigner, read_hmac_key
from daemon.client.tls_diagnosis import tls_diagnosis, tls_problem
from daemon.delta import shipped_files
from daemon.formats import MANIFEST_NAME
from daemon.manifest import Manifest, ManifestError, Signature, Signer, load_manifest, publish

__all__ = ["PushError", "ensure_manifest", "parse_s3_url", "publish_delta", "publish_s3", "push"]

MIB = 1024 * 1024
RETRY_STATUSES = {429, 500, 502, 503, 504}


class PushError(RuntimeError):
    """The daemon refused the push (the message carries its status and reason) or stayed unreachable."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def ensure_manifest(directory: Path, version: str | None = None, signer: Signer | None = None) -> Manifest:
    """The directory's manifest; written (hashing every file) when there is none."""
    if (directory / MANIFEST_NAME).is_file():
        manifest = load_manifest(directory)
        if version is not None and manifest.version != version:
            raise ManifestError(f"{directory}: its manifest says version {manifest.version!r}, not {version!r}")
        return manifest
    return publish(directory, version=version, signer=signer)


def publish_delta(directory: str | os.PathLike[str], base: str | os.PathLike[str], out: str | os.PathLike[str],
                  **options: Any) -> Any:  # fmt: skip
    """daemon.delta.build.publish_delta (imported when called: `hotswap push` loads no numpy)."""
    from daemon.delta import publish_delta as build

    return build(directory, base, out, **options)


def _b64crc(hex8: str) -> str:
    return base64.b64encode(bytes.fromhex(hex8)).decode()


# --------------------------------------------------------------------------- S3


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix ending in "/") of s3://bucket/prefix/version."""
    if not url.startswith("s3://"):
        raise ValueError(f"{url!r}: expected s3://bucket/prefix/version")
    bucket, _, key = url[5:].partition("/")
    key = key.strip("/")
    if not bucket or not key:
        raise ValueError(f"{url!r}: expected s3://bucket/prefix/version (a version folder is needed)")
    return bucket, key + "/"


def publish_s3(
    directory: str | os.PathLike[str],
    url: str,
    *,
    client: Any = None,
    endpoint_url: str | None = None,
    signer: Signer | None = None,
    concurrency: int = 8,
    part_bytes: int = 32 * MIB,
) -> Manifest:
    """Upload a checkpoint to `s3://bucket/prefix/<version>/`: every file first (a delta checkpoint's:
    its delta files and its compacted delta's, daemon.delta), the manifest last."""
    root = Path(directory)
    bucket, prefix = parse_s3_url(url)
    manifest = ensure_manifest(root, prefix.rstrip("/").rsplit("/", 1)[-1], signer)
    s3 = client or boto3.client("s3", endpoint_url=endpoint_url)
    n = max(1, concurrency)
    # files in one pool, the parts of multipart files in another (the file tasks wait on parts)
    with ThreadPoolExecutor(n, thread_name_prefix="s3-put") as files, \
            ThreadPoolExecutor(n, thread_name_prefix="s3-part") as parts:
        futures = []
        moved = shipped_files(manifest, str(root))
        for f in moved:
            size = f.bytes
            if size <= part_bytes:
                futures.append(files.submit(_put_small, s3, bucket, prefix + f.path, root / f.path, f.crc32c))
            else:
                futures.append(files.submit(_put_multipart, s3, bucket, prefix + f.path, root / f.path, f.crc32c,
                                            size, max(part_bytes, -(-size // 10000)), parts))  # fmt: skip
        for fut in futures:
            fut.result()
    s3.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=(root / MANIFEST_NAME).read_bytes(),
                  ChecksumAlgorithm="CRC32C")  # fmt: skip
    return manifest


def _put_small(s3: Any, bucket: str, key: str, path: Path, crc: str) -> None:
    with open(path, "rb") as body:
        s3.put_object(Bucket=bucket, Key=key, Body=body, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=_b64crc(crc))


def _put_multipart(s3: Any, bucket: str, key: str, path: Path, crc: str, size: int, part: int,
                   pool: ThreadPoolExecutor) -> None:  # fmt: skip
    up = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT")
    upload_id = up["UploadId"]

    def one(n: int) -> dict[str, Any]:
        with open(path, "rb") as f:
            f.seek((n - 1) * part)
            data = f.read(part)
        r = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=data,
                           ChecksumAlgorithm="CRC32C")  # fmt: skip
        return {"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32C": r["ChecksumCRC32C"]}

    try:
        parts = [fut.result() for fut in [pool.submit(one, n) for n in range(1, -(-size // part) + 1)]]
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts},
                                     ChecksumCRC32C=_b64crc(crc), ChecksumType="FULL_OBJECT")  # fmt: skip
    except BaseException:
        s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        raise


# --------------------------------------------------------------------------- push


def _signed(manifest: Manifest, key: bytes | str | os.PathLike[str] | None, key_id: str) -> bytes:
    if key is None:
        if manifest.signature is None:
            raise PushError("the manifest is unsigned and no key was given: the daemon accepts signed pushes only")
        return manifest.to_json().encode()
    raw_key = key if isinstance(key, bytes) else read_hmac_key(Path(key))
    signer = HmacSigner(key_id, raw_key)
    return replace(manifest, signature=Signature(signer.alg, key_id, signer.sign(manifest.canonical()))).to_json().encode()


def _chunks(path: Path, progress: Any, task: Any) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            if progress is not None:
                progress.advance(task, len(chunk))
            yield chunk


def push(
    directory: str | os.PathLike[str],
    url: str,
    token: str,
    key: bytes | str | os.PathLike[str] | None,
    *,
    key_id: str = "default",
    version: str | None = None,
    verify: bool | str = True,  # a CA bundle path for a private CA
    cert: tuple[str, str] | None = None,  # (certificate, key) files for mTLS
    retries: int = 3,
    timeout_s: float = 300.0,
    progress: bool | None = None,  # None: a bar when stderr is a terminal
) -> dict[str, Any]:
    """Push one checkpoint; returns the daemon's answer to the commit. Raises PushError when refused."""
    root = Path(directory)
    manifest = ensure_manifest(root, version)
    body = _signed(manifest, key, key_id)
    base = url.rstrip("/") + f"/v1/push/{quote(manifest.version or root.name, safe='')}"
    headers = {"Authorization": f"Bearer {token}"}
    show = sys.stderr.isatty() if progress is None else progress
    bar: Any = None
    if show:
        bar = Progress(*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn(), transient=True)
        bar.start()
    try:
        tls = _tls_context(verify, cert)

        def diagnose() -> str | None:
            return tls_diagnosis(url, tls, cert is not None) if isinstance(tls, ssl.SSLContext) else None

        with httpx.Client(verify=tls, timeout=timeout_s) as http:
            for f in shipped_files(manifest, str(root)):  # a delta checkpoint: its delta files (and compacted ones)
                task = bar.add_task(f.path, total=f.bytes) if bar is not None else None
                answer = _with_retries(retries, f.path, lambda f=f, task=task: http.put(
                    f"{base}/files/{quote(f.path)}", params={"alg": manifest.hash_alg or "blake3"},
                    content=_chunks(root / f.path, bar, task),
                    headers={**headers, "Content-Length": str(f.bytes)}), diagnose)  # fmt: skip
                if answer.get("bytes") != f.bytes or answer.get(manifest.hash_alg or "") != f.hash:
                    raise PushError(f"{f.path}: the daemon hashed {answer} but the manifest lists {f}")
                if bar is not None:
                    bar.remove_task(task)
            return _with_retries(retries, "commit", lambda: http.post(
                f"{base}/commit", content=body, headers={**headers, "Content-Type": "application/json"}), diagnose)  # fmt: skip
    finally:
        if bar is not None:
            bar.stop()


def _tls_context(verify: bool | str, cert: tuple[str, str] | None) -> ssl.SSLContext | bool:
    """What httpx verifies with: a context holding the private CA and the client certificate (mTLS)."""
    if verify is False:
        if cert is not None:
            raise ValueError("a client certificate needs TLS verification on")
        return False
    ctx = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def _with_retries(retries: int, what: str, send: Any, diagnose: Callable[[], str | None] | None = None) -> dict[str, Any]:
    delay = 0.5
    for attempt in range(retries + 1):
        try:
            resp = send()
        except httpx.TransportError as exc:
            if attempt == 0 and (cause := tls_problem(exc) or (diagnose() if diagnose else None)):
                raise PushError(f"{what}: {cause}") from None  # trying again cannot help: say what is wrong
            if attempt == retries:
                raise PushError(f"{what}: daemon unreachable after {retries + 1} tries ({exc})") from None
        else:
            if resp.status_code < 300:
                return dict(resp.json())
            if resp.status_code not in RETRY_STATUSES or attempt == retries:
                try:
                    reason = resp.json().get("error") or resp.json().get("detail")
                except ValueError:
                    reason = resp.text[:200]
                raise PushError(f"{what}: {resp.status_code} {reason}{_hint(resp.status_code)}", resp.status_code)
            wait = resp.headers.get("retry-after")
            delay = float(wait) if wait and wait.replace(".", "").isdigit() else delay
        time.sleep(min(delay, 30.0))
        delay *= 2
    raise PushError(f"{what}: gave up")  # not reached


def _hint(status: int) -> str:
    if status == 401:
        return (" (send the token in the push source's token_file, [[sources]] type = \"push\"; "
                "the daemon's control.token is for its control API)")
    if status == 404:
        return " (no push route here: --to must be the push source's listen address, default port 8781)"
    return ""

