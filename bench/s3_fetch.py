"""S3 fetch throughput: the S3 source's parallel ranged GETs against one boto3 GET stream (`aws s3 cp`-style).

Starts a moto S3 server subprocess on loopback, uploads one checkpoint (`--files` files of random
bytes, `--mib` MiB in all, manifest last, via daemon.client.publish_s3), then downloads it into a
fresh folder each time:
  * single stream: one `get_object` per file, body streamed to disk (what `aws s3 cp` does
    without its multipart download), no verification;
  * ours: daemon.sources.s3fetch.fetch_checkpoint with 1, 4 and 16 parallel ranges of
    `--part-mib`, which also verifies every file (CRC32C + BLAKE3, and S3's FULL_OBJECT CRC32C);
  * ours without the verify time: the same minus the hashing, measured separately from the
    page cache (so the download rate itself is visible).
moto is a Python server: on loopback it, not the network, is the ceiling; the figures compare
the client strategies on one machine, not S3's own rates.

    .venv/bin/python -m bench.s3_fetch [--mib 1024] [--files 4] [--part-mib 16] [--repeats 2]
        [--out .bench-out/s3_fetch.json] [--endpoint-url URL --bucket B]   # a real store instead of moto
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3

from bench.common import print_table, write_json
from daemon.bytepipe.files import hash_files
from daemon.client.publish import publish_s3
from daemon.sources.s3fetch import fetch_checkpoint

CREDS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench-secret", "region_name": "us-east-1"}
MIB = 1024 * 1024


def start_moto() -> tuple[subprocess.Popen[bytes] | None, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)


def single_stream(s3: Any, bucket: str, prefix: str, names: list[str], dest: Path) -> None:
    dest.mkdir(parents=True)
    for name in names:
        body = s3.get_object(Bucket=bucket, Key=prefix + name)["Body"]
        with open(dest / name, "wb") as f:
            for chunk in body.iter_chunks(MIB):
                f.write(chunk)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ranges", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--out", default=".bench-out/s3_fetch.json")
    ap.add_argument("--endpoint-url", help="a real S3-compatible store instead of moto (boto3 credential chain)")
    ap.add_argument("--bucket", default="bench", help="with --endpoint-url: an existing bucket to write run/ into")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hotswap-s3bench-"))
    proc, url = start_moto() if args.endpoint_url is None else (None, args.endpoint_url)
    try:
        s3 = boto3.client("s3", endpoint_url=url, **(CREDS if proc is not None else {}))
        if proc is not None:
            s3.create_bucket(Bucket=args.bucket)
        src = work / "src" / "step-1"
        src.mkdir(parents=True)
        per_file = args.mib * MIB // args.files
        for i in range(args.files):
            with open(src / f"shard-{i}.bin", "wb") as f:
                for _ in range(per_file // MIB):
                    f.write(os.urandom(MIB))
        t0 = time.perf_counter()
        manifest = publish_s3(src, f"s3://{args.bucket}/run/step-1", client=s3, concurrency=4)
        upload_s = time.perf_counter() - t0
        total = manifest.total_bytes
        names = [f.path for f in manifest.files]
        rows: list[list[Any]] = []
        results: list[dict[str, Any]] = []

        def record(what: str, seconds: list[float]) -> None:
            best = min(seconds)
            rows.append([what, f"{best:.2f}", f"{total / best / 1e9:.3f}", " / ".join(f"{s:.2f}" for s in seconds)])
            results.append({"what": what, "seconds": seconds, "best_gb_s": total / best / 1e9})

        times = []
        for r in range(args.repeats):
            dest = work / f"single-{r}"
            t0 = time.perf_counter()
            single_stream(s3, args.bucket, "run/step-1/", names, dest)
            times.append(time.perf_counter() - t0)
            shutil.rmtree(dest)
        record("single stream get_object (no verify)", times)
        t0 = time.perf_counter()
        hash_files([src / n for n in names])
        verify_s = time.perf_counter() - t0
        for n in args.ranges:
            times, net = [], []
            for r in range(args.repeats):
                dest = work / f"cache-{n}-{r}" / "step-1"
                t0 = time.perf_counter()
                fetch_checkpoint(s3, args.bucket, "run/step-1/", dest, lambda d, t: None, concurrency=n,
                                 part_bytes=args.part_mib * MIB)  # fmt: skip
                times.append(time.perf_counter() - t0)
                net.append(max(1e-6, times[-1] - verify_s))
                shutil.rmtree(dest.parent)
            record(f"ours, {n} parallel range(s) x {args.part_mib} MiB, verified", times)
            record(f"ours, {n} parallel range(s), minus verify ({verify_s:.2f} s)", net)
        print_table(f"S3 fetch from moto on loopback, {total / 1e9:.2f} GB in {args.files} files",
                    ["what", "best s", "GB/s", "runs (s)"], rows)  # fmt: skip
        doc = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
               "cpus": os.cpu_count(), "bytes": total, "files": args.files, "part_mib": args.part_mib,
               "upload_s": upload_s, "verify_s": verify_s, "results": results, "command": " ".join(sys.argv)}  # fmt: skip
        write_json(args.out, doc)
        print(f"upload (publish_s3, 4 threads): {upload_s:.2f} s; verify from page cache: {verify_s:.2f} s")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
