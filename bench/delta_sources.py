"""Delta checkpoints over S3 (moto) and push: bytes each host fetched, full vs delta (issue 38).

    python -m bench.delta_sources [--hosts 2] [--density 0.01] [--out bench/results/delta_sources-2core.json]

Real processes: a moto S3 server on loopback (bench/s3_fetch.py's), and `--hosts` real daemons
(bench/faults_rig.py's `Rig`: each its own state, SQLite registry and managed tiny-model worker),
every one watching the same bucket prefix and listening for authenticated pushes (bearer token,
HMAC-signed manifests). Per source, the trainer publishes a full base, then the same checkpoint
with `--density` of its elements changed (a step of >= one ulp) as a delta of that base:

* S3: `publish_s3` of the base, then of `publish_delta`'s folder (only its delta files go up);
* push: `push` of each to every host (push is per host: the trainer sends to each).

Each version must be serving on every host's worker before the next one. Per host and version,
the bytes fetched come from the daemon's own counters (`hotswap_fetched_bytes_total{source,
encoding}` on /metrics, the difference across the version) and are checked against its registry
row (`checkpoints.fetched_bytes`, `encoding`). The tiny model keeps this on a 2-core VM: the
figures are its bytes, the point is full vs delta per host and that the counters say so.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import httpx
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from sqlalchemy import text

from bench.common import print_table, write_json
from bench.faults_rig import Rig
from bench.s3_fetch import CREDS, start_moto
from daemon.checks.signatures import HmacSigner
from daemon.client import publish_delta, publish_s3, push
from daemon.delta.anchors import AnchorRule
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.manifest import publish
from daemon.tinymodel import make_tiny_checkpoint

TOKEN = "bench-delta-sources-token"
KEY_ID = "trainer"
CHECKS = ["manifest", "headers", "crc32c", "compat", "finite"]
ALWAYS_DELTA = AnchorRule(share=100.0)  # never an anchor: the bench wants the delta


def perturb(src: Path, dst: Path, density: float, seed: int) -> None:
    """dst: src with `density` of every float tensor's elements moved by a 2 % relative step
    (at least one ulp in bf16 and fp32), other files copied (no manifest)."""
    rng = np.random.default_rng(seed)
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            out = {}
            for k, v in load_file(f).items():
                if not v.is_floating_point():
                    out[k] = v
                    continue
                x = v.float()
                hit = torch.from_numpy(rng.random(x.numel(), dtype=np.float32) < density).view(x.shape)
                out[k] = torch.where(hit, x + x.abs().clamp_min(1e-3) * 0.02, x).to(v.dtype).contiguous()
            save_file(out, dst / f.name)
        elif f.is_file() and f.name != MANIFEST_NAME:
            shutil.copy2(f, dst / f.name)


def counters(rig: Rig) -> dict[tuple[str, str], float]:
    """hotswap_fetched_bytes_total by (source, encoding), from the daemon's /metrics."""
    body = httpx.get(rig.api_url + "/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for m in re.finditer(r"^hotswap_fetched_bytes_total\{([^}]*)\} (\S+)$", body, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[(labels.get("source", ""), labels.get("encoding", ""))] = float(m.group(2))
    return out


def registry_row(rig: Rig, version: str) -> dict[str, Any]:
    with rig.engine().connect() as c:
        row = c.execute(text("SELECT encoding, fetched_bytes, delta_base FROM checkpoints WHERE version = :v"),
                        {"v": version}).one()  # fmt: skip
    return {"encoding": row[0], "fetched_bytes": row[1], "delta_base": row[2]}


def push_url(rig: Rig) -> str:
    status = httpx.get(rig.api_url + "/status", timeout=10).json()
    (src,) = [s for s in status["sources"] if s["name"] == "push"]
    return str(src["url"])


def start_hosts(work: Path, n: int, moto_url: str, key: Path) -> list[Rig]:
    (work / "token").write_text(TOKEN + "\n")
    env = {"AWS_ACCESS_KEY_ID": CREDS["aws_access_key_id"], "AWS_SECRET_ACCESS_KEY": CREDS["aws_secret_access_key"],
           "AWS_DEFAULT_REGION": CREDS["region_name"]}  # fmt: skip
    rigs = []
    for i in range(n):
        root = work / f"host-{i}"
        sources: list[dict[str, Any]] = [{"type": "s3", "name": "bucket", "bucket": "ckpts", "prefix": "run/", "endpoint_url": moto_url,
                    "poll_interval_s": 0.5, "cache_dir": str(root / "s3cache")},
                   {"type": "push", "name": "push", "path": str(root / "pushed"), "token_file": str(work / "token"),
                    "listen": "127.0.0.1:0", "hmac_keys": {KEY_ID: str(key)}}]  # fmt: skip
        rigs.append(Rig(root, workers=0, sources=sources, env=env,
                        checks={"enabled": CHECKS, "hmac_keys": {KEY_ID: str(key)}}))  # fmt: skip
    for r in rigs:  # one at a time: their workers' imports would share 2 cores
        r.start()
        r.wait_settled("tiny-seed", timeout=240)
    return rigs


def deliver(rigs: list[Rig], source: str, version: str, folder: Path, s3: Any) -> list[dict[str, Any]]:
    """Send one published folder by `source` and wait until every host serves it; per host, what
    its counters and its registry row say it fetched."""
    before = [counters(r) for r in rigs]
    t0 = time.perf_counter()
    if source == "bucket":
        publish_s3(folder, f"s3://ckpts/run/{version}", client=s3)
    else:
        for r in rigs:
            answer = push(folder, push_url(r), TOKEN, None, retries=0, timeout_s=120, progress=False)
            assert answer["status"] == "committed", answer
    rows = []
    for i, (r, b) in enumerate(zip(rigs, before, strict=True)):
        r.wait_settled(version, timeout=300)
        after = counters(r)
        per = {enc: after.get((source, enc), 0.0) - b.get((source, enc), 0.0) for enc in ("full", "delta")}
        rows.append({"host": i, "source": source, "version": version, "serving_s": round(time.perf_counter() - t0, 2),
                     "counter_full_bytes": int(per["full"]), "counter_delta_bytes": int(per["delta"]),
                     **registry_row(r, version)})  # fmt: skip
    return rows


def shipped(folder: Path) -> int:
    """Bytes of the files a fetch moves (every file but the manifest)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    key = work / "hmac.key"
    key.write_bytes(os.urandom(32).hex().encode())
    signer = HmacSigner(KEY_ID, key.read_bytes())
    proc, url = start_moto()
    rigs: list[Rig] = []
    try:
        s3 = boto3.client("s3", endpoint_url=url, **CREDS)
        s3.create_bucket(Bucket="ckpts")
        rigs = start_hosts(work, args.hosts, url, key)
        rows: list[dict[str, Any]] = []
        sizes: dict[str, dict[str, int]] = {}
        for n, (source, tag) in enumerate((("bucket", "s3"), ("push", "push"))):
            base, new, out = (
                work / "trainer" / f"{tag}-base",
                work / "trainer" / f"{tag}-new",
                work / "out" / f"{tag}-delta",
            )
            make_tiny_checkpoint(base, seed=n + 1)
            publish(base, version=f"{tag}-base", signer=signer)
            perturb(base, new, args.density, seed=n + 7)
            delta = publish_delta(new, base, out, version=f"{tag}-delta", signer=signer, rule=ALWAYS_DELTA)
            assert delta.spec is not None, "the delta was published as a full version"
            sizes[source] = {"full_bytes": shipped(base), "delta_bytes": shipped(out),
                             "result_bytes": delta.spec.full_bytes, "manifest_delta_bytes": delta.spec.delta_bytes}  # fmt: skip
            rows += deliver(rigs, source, f"{tag}-base", base, s3)
            rows += deliver(rigs, source, f"{tag}-delta", out, s3)
    finally:
        for r in rigs:
            r.stop()
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
    return {"rows": rows, "sizes": sizes}


def summary(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per source: bytes per host (max over hosts) for the full and the delta version, their ratio,
    and whether every host's counter matches its registry row and the delta's file bytes."""
    out = []
    for source, size in doc["sizes"].items():
        rs = [r for r in doc["rows"] if r["source"] == source]
        full = [r["counter_full_bytes"] for r in rs if r["encoding"] != "delta"]
        delta = [r["counter_delta_bytes"] for r in rs if r["encoding"] == "delta"]
        consistent = all(
            r["fetched_bytes"] == (r["counter_delta_bytes"] or r["counter_full_bytes"]) for r in rs
        )
        consistent &= all(r["counter_full_bytes"] == 0 for r in rs if r["encoding"] == "delta")
        out.append({"source": source, "hosts": len(full), "full_bytes_per_host": max(full),
                    "delta_bytes_per_host": max(delta), "ratio": max(delta) / max(full),
                    "origin_full_bytes": sum(full), "origin_delta_bytes": sum(delta),
                    "delta_file_bytes": size["delta_bytes"], "counters_match_registry": consistent,
                    "only_delta_fetched": all(d == size["manifest_delta_bytes"] for d in delta)})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2, help="real daemons, each its own host")
    ap.add_argument("--density", type=float, default=0.01, help="share of elements the delta version changes")
    ap.add_argument("--out", default="bench/results/delta_sources-2core.json")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-delta-sources-"))
    try:
        doc: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                               "cpus": os.cpu_count(), "density": args.density, "hosts": args.hosts,
                               "command": " ".join(["python -m bench.delta_sources", *(argv or sys.argv[1:])]),
                               **run(args, work)}  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["summary"] = summary(doc)
    write_json(args.out, doc)
    print_table(f"bytes fetched per host (daemon counters), {args.hosts} hosts, {100 * args.density:g} % of elements "
                "changed", ["source", "full / host", "delta / host", "delta / full", "origin full", "origin delta",
                            "counters = registry", "only the delta fetched"],
                [[s["source"], s["full_bytes_per_host"], s["delta_bytes_per_host"], f"{100 * s['ratio']:.2f} %",
                  s["origin_full_bytes"], s["origin_delta_bytes"], s["counters_match_registry"], s["only_delta_fetched"]]
                 for s in doc["summary"]])  # fmt: skip
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
