"""`hotswap publish DIR`: write hotswap-manifest.json for a checkpoint directory (last).

With `--to s3://bucket/prefix/version` the manifest is written and the checkpoint uploaded
(daemon.client.publish.publish_s3: files first, the manifest last). Heavy imports (boto3, the
hashing) stay inside the functions: `hotswap` starts fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def publish_parser() -> argparse.ArgumentParser:
    """Every option of `hotswap publish`, the upload ones in a group of their own."""
    from daemon.hashing import DEFAULT_HASH_ALG, HASH_ALGORITHMS  # here: `hotswap` stays quick to start

    ap = argparse.ArgumentParser(
        prog="hotswap publish",
        description="Write hotswap-manifest.json (sizes and hashes of every file, optionally signed) into "
        "DIR, last, so a watching daemon sees the checkpoint as committed. With --to, upload it too.",
    )
    ap.add_argument("directory", metavar="DIR", type=Path, help="the checkpoint directory (Hugging Face layout)")
    ap.add_argument("--version", help="version label (default: the directory name, or the last part of --to)")
    ap.add_argument("--step", type=int, help="training step: orders versions (newest = highest step, then arrival)")
    ap.add_argument("--parent", help="the version this one was trained from (recorded, informational)")
    ap.add_argument("--adapter", metavar="NAME",
                    help="a LoRA adapter (PEFT layout): the name clients send as 'model', the same for all its versions")
    ap.add_argument("--base-model", metavar="NAME",
                    help="the base the adapter was trained for (default: adapter_config.json base_model_name_or_path)")
    ap.add_argument("--key-file", type=Path, help="HMAC shared key or Ed25519 private key (PEM or raw 32 bytes)")
    ap.add_argument("--key-id", help="the key's id, as the daemon's [checks] hmac_keys / ed25519_keys name it")
    ap.add_argument("--alg", choices=["hmac-sha256", "ed25519"], default="hmac-sha256",
                    help="signature algorithm of --key-file (default hmac-sha256)")  # fmt: skip
    ap.add_argument("--hash", choices=list(HASH_ALGORITHMS), default=DEFAULT_HASH_ALG,
                    help=f"per-file strong hash (default {DEFAULT_HASH_ALG}: fastest, uses every core)")  # fmt: skip
    ap.add_argument("--threads", type=int, help="hashing threads (default: one per CPU core)")
    de = ap.add_argument_group("delta (ship only what changed since a base; daemon.delta)")
    de.add_argument("--delta-from", metavar="BASE", type=Path,
                    help="the base's folder (full files and its manifest): encode DIR against it and write "
                    "the delta checkpoint into --out (DIR keeps its full files and gets the manifest too)")
    de.add_argument("--out", metavar="OUT", type=Path, help="with --delta-from: the new folder the delta goes to "
                    "(e.g. WATCHED/VERSION); the manifest is written there last")
    de.add_argument("--anchor-every", metavar="N", type=int, default=0,
                    help="a full checkpoint every N versions (default 0: adaptive, see --anchor-share)")
    de.add_argument("--anchor-share", metavar="F", type=float, default=0.5,
                    help="adaptive anchors: ship a full checkpoint once the chain's delta bytes since the last "
                    "one pass F of a full checkpoint (default 0.5)")
    de.add_argument("--compact", action=argparse.BooleanOptionalAction, default=None,
                    help="also write the compacted delta (from the chain's anchor straight to DIR, under "
                    "OUT/hotswap-compact/) for hosts without the base (default: when the chain has more than "
                    "one link and the anchor's folder is found; --compact makes a missing one an error)")
    de.add_argument("--anchor-dir", metavar="ANCHOR", type=Path,
                    help="the anchor's folder of full files (default: the folder of its name beside BASE)")
    up = ap.add_argument_group("upload (after writing the manifest)")
    up.add_argument("--to", metavar="s3://BUCKET/PREFIX/VERSION", help="upload: the files first, the manifest last")
    up.add_argument("--endpoint-url", metavar="URL", help="an S3-compatible store (default: AWS)")
    up.add_argument("--concurrency", type=int, default=8, help="parallel uploads (default 8)")
    return ap


def publish_main(argv: Sequence[str] | None = None) -> int:
    """`hotswap publish DIR [--version V] [--step N] [--parent P] [--adapter NAME [--base-model B]] [--hash blake3|sha256]
    [--key-file F --key-id ID [--alg A]] [--to s3://BUCKET/PREFIX/VERSION]`."""
    args = publish_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.delta_from is not None:
        return write_delta(args)
    if args.to is None:
        return write_manifest(args)
    return upload_s3(args)


def write_manifest(args: argparse.Namespace) -> int:
    from daemon.checks import SignatureError, load_signer  # here: `hotswap` stays quick to start
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
        extra = {k: v for k, v in (("adapter", args.adapter), ("base_model", args.base_model)) if v}
        m = publish(args.directory, args.version, args.step, args.parent, signer, hash_alg=args.hash,
                    threads=args.threads, extra=extra)  # fmt: skip
    except (ManifestError, OSError) as exc:
        print(f"hotswap publish: {exc}", file=sys.stderr)
        return 1
    signed = f", signed {m.signature.alg}/{m.signature.key_id}" if m.signature else ""
    print(f"published {m.version}: {len(m.files)} files, {m.total_bytes} bytes, digest {m.digest}{signed}")
    return 0


def write_delta(args: argparse.Namespace) -> int:
    """`hotswap publish DIR --delta-from BASE --out OUT`: the delta (or a full anchor) into OUT, manifest last."""
    from daemon.checks import SignatureError, load_signer  # here: `hotswap` stays quick to start
    from daemon.delta import AnchorRule, DeltaError, publish_delta
    from daemon.manifest import ManifestError

    if args.out is None or args.adapter:
        print("hotswap publish: --delta-from needs --out (the new folder the delta is written to, and uploaded "
              "from with --to), and goes without --adapter", file=sys.stderr)  # fmt: skip
        return 2
    if args.to is not None and args.version is None:  # the folder in the URL is the version
        args.version = args.to.rstrip("/").rsplit("/", 1)[-1]
    if (args.key_file is None) != (args.key_id is None):
        print("hotswap publish: --key-file and --key-id go together", file=sys.stderr)
        return 2
    try:
        rule = AnchorRule(args.anchor_every, args.anchor_share)
        signer = load_signer(args.alg, args.key_id, args.key_file) if args.key_file is not None else None
        p = publish_delta(args.directory, args.delta_from, args.out, version=args.version or args.out.name,
                          step=args.step, parent=args.parent, signer=signer, hash_alg=args.hash,
                          threads=args.threads, rule=rule, compact=args.compact,
                          anchor_dir=args.anchor_dir)  # fmt: skip
    except (ValueError, SignatureError) as exc:
        print(f"hotswap publish: {exc}", file=sys.stderr)
        return 2 if not isinstance(exc, ManifestError | DeltaError) else 1
    except OSError as exc:
        print(f"hotswap publish: {exc}", file=sys.stderr)
        return 1
    m = p.manifest
    if p.spec is None:
        print(f"published {m.version} as a full checkpoint (an anchor: {p.anchor_reason}): {len(m.files)} files, "
              f"{m.total_bytes} bytes, digest {m.digest}")  # fmt: skip
    else:
        s = p.spec
        print(f"published {m.version} as a delta of {s.base_version}: {len(s.files)} delta files, {s.delta_bytes} of "
              f"{s.full_bytes} bytes ({100 * s.ratio:.2f} %), chain since anchor {s.anchor}: {s.chain_length} deltas, "
              f"digest {m.digest}")  # fmt: skip
        if s.compacted is not None:
            print(f"  compacted delta from {s.compacted.base_version}: {s.compacted.delta_bytes} bytes (the chain: "
                  f"{s.chain_bytes})")  # fmt: skip
        elif p.compact_skipped:
            print(f"  no compacted delta: {p.compact_skipped}")
    return upload(args.out, args) if args.to is not None else 0


def upload_s3(args: argparse.Namespace) -> int:
    """`hotswap publish DIR --to s3://...`: the manifest (version: the URL's last part), then the upload."""
    from daemon.client import parse_s3_url

    try:
        parse_s3_url(args.to)
    except ValueError as exc:
        print(f"hotswap publish: --to: {exc}", file=sys.stderr)
        return 2
    if args.version is None:  # the folder in the URL is the version
        args.version = args.to.rstrip("/").rsplit("/", 1)[-1]
    code = write_manifest(args)
    return code if code != 0 else upload(args.directory, args)


def upload(directory: Path, args: argparse.Namespace) -> int:
    """The upload of a published folder to --to: its files (a delta's: only its delta files), manifest last."""
    from botocore.exceptions import BotoCoreError, ClientError  # boto3: only when uploading

    from daemon.client import publish_s3
    from daemon.delta import DeltaError, shipped_files
    from daemon.manifest import ManifestError

    try:
        m = publish_s3(directory, args.to, endpoint_url=args.endpoint_url, concurrency=args.concurrency)
        moved = shipped_files(m, str(directory))
    except (ManifestError, DeltaError, OSError, ValueError, BotoCoreError, ClientError) as exc:
        print(f"hotswap publish: upload to {args.to} failed: {exc}", file=sys.stderr)
        return 1
    print(f"uploaded {m.version} to {args.to}: {len(moved)} files ({sum(f.bytes for f in moved)} bytes) "
          "and the manifest (last)")  # fmt: skip
    return 0
