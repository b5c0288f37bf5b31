"""`hotswap publish DIR`: write hotswap-manifest.json for a checkpoint directory (last).

Kept apart from daemon.cli so `daemon.client.cli` (which adds `--to s3://...`) can use it
without importing the whole CLI. Heavy imports stay inside the function: `hotswap` starts fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def publish_main(argv: Sequence[str] | None = None) -> int:
    """`hotswap publish DIR [--version V] [--step N] [--parent P] [--hash blake3|sha256]
    [--key-file F --key-id ID [--alg A]]`."""
    from daemon.hashing import DEFAULT_HASH_ALG, HASH_ALGORITHMS  # here: `hotswap` stays quick to start

    ap = argparse.ArgumentParser(prog="hotswap publish", description="Write hotswap-manifest.json (last).")
    ap.add_argument("directory", type=Path)
    ap.add_argument("--version", help="version label (default: the directory name)")
    ap.add_argument("--step", type=int)
    ap.add_argument("--parent")
    ap.add_argument(
        "--key-file", type=Path, help="HMAC shared key or Ed25519 private key (PEM or raw 32 bytes)"
    )
    ap.add_argument("--key-id")
    ap.add_argument("--alg", choices=["hmac-sha256", "ed25519"], default="hmac-sha256")
    ap.add_argument(
        "--hash",
        choices=list(HASH_ALGORITHMS),
        default=DEFAULT_HASH_ALG,
        help=f"per-file strong hash (default {DEFAULT_HASH_ALG}: fastest, uses every core)",
    )
    ap.add_argument("--threads", type=int)
    args = ap.parse_args(argv)
    from daemon.checks.signatures import SignatureError, load_signer  # here: `hotswap` stays quick to start
    from daemon.manifest import ManifestError, publish

    signer = None
    if (args.key_file is None) != (args.key_id is None):
        print("hotswap publish: --key-file and --key-id go together", file=sys.stderr)
        return 2
    try:
        if args.key_file is not None:
            try:
                signer = load_signer(args.alg, args.key_id, args.key_file)
            except SignatureError as exc:
                print(f"hotswap publish: {exc}", file=sys.stderr)
                return 2
        m = publish(
            args.directory, args.version, args.step, args.parent, signer, hash_alg=args.hash, threads=args.threads
        )
    except (ManifestError, OSError) as exc:
        print(f"hotswap publish: {exc}", file=sys.stderr)
        return 1
    signed = f", signed {m.signature.alg}/{m.signature.key_id}" if m.signature else ""
    print(f"published {m.version}: {len(m.files)} files, {m.total_bytes} bytes, digest {m.digest}{signed}")
    return 0
