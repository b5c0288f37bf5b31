"""`hotswap publish DIR [--to s3://bucket/prefix/version]` and `hotswap push DIR --to https://host:8781`.

`publish` without `--to` is the plain manifest writer (daemon.cli.publish_main); with `--to` the
manifest is written and the checkpoint uploaded (daemon.client.publish.publish_s3: files first,
the manifest last). `push` streams the checkpoint to a daemon's push source, signing the manifest
with `--key-file` (HMAC-SHA256); the token comes from `--token-file` or $HOTSWAP_PUSH_TOKEN.
Exit codes: 0 done, 1 refused or failed (one line on stderr), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from daemon.auth import TokenFileError, read_token_file
from daemon.checks.signatures import SignatureError
from daemon.client.publish import PushError, parse_s3_url, publish_s3, push
from daemon.manifest import ManifestError
from daemon.publish_cmd import publish_main as write_manifest_main


def publish_main(argv: Sequence[str] | None = None) -> int:
    """`hotswap publish DIR ... [--to s3://bucket/prefix/version [--endpoint-url URL] [--concurrency N]]`."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--to")
    ap.add_argument("--endpoint-url")
    ap.add_argument("--concurrency", type=int, default=8)
    ours, rest = ap.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if ours.to is None:
        return write_manifest_main(rest)
    try:
        parse_s3_url(ours.to)
    except ValueError as exc:
        print(f"hotswap publish: --to: {exc}", file=sys.stderr)
        return 2
    dirs = _positionals(rest)
    if "--version" not in rest and dirs:  # the folder in the URL is the version
        rest += ["--version", ours.to.rstrip("/").rsplit("/", 1)[-1]]
    code = write_manifest_main(rest)
    if code != 0 or not dirs:
        return code
    try:
        m = publish_s3(Path(dirs[0]), ours.to, endpoint_url=ours.endpoint_url, concurrency=ours.concurrency)
    except (ManifestError, OSError, ValueError, BotoCoreError, ClientError) as exc:
        print(f"hotswap publish: upload to {ours.to} failed: {exc}", file=sys.stderr)
        return 1
    print(f"uploaded {m.version} to {ours.to}: {len(m.files)} files and the manifest (last)")
    return 0


_VALUED = {"--version", "--step", "--parent", "--key-file", "--key-id", "--alg", "--hash", "--threads"}


def _positionals(argv: list[str]) -> list[str]:
    """The arguments of `hotswap publish` that are not options or their values (the directory)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in _VALUED:
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def push_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hotswap push", description="Stream a checkpoint to a daemon's push source.")
    ap.add_argument("directory", type=Path)
    ap.add_argument("--to", required=True, help="the push listener, e.g. https://host:8781")
    ap.add_argument("--token-file", type=Path, help="bearer token file (default: $HOTSWAP_PUSH_TOKEN)")
    ap.add_argument("--key-file", type=Path, help="HMAC key that signs the manifest (else it must be signed)")
    ap.add_argument("--key-id", default="default")
    ap.add_argument("--version", help="version label when the directory has no manifest yet")
    ap.add_argument("--cacert", help="CA bundle that signed the daemon's certificate")
    ap.add_argument("--cert", help="client certificate (mTLS)")
    ap.add_argument("--cert-key", help="client certificate's key (mTLS)")
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if bool(args.cert) != bool(args.cert_key):
        print("hotswap push: --cert and --cert-key go together", file=sys.stderr)
        return 2
    try:
        token = read_token_file(args.token_file) if args.token_file else os.environ.get("HOTSWAP_PUSH_TOKEN", "")
        if not token:
            print("hotswap push: no token: pass --token-file or set HOTSWAP_PUSH_TOKEN", file=sys.stderr)
            return 2
        answer = push(args.directory, args.to, token, args.key_file, key_id=args.key_id, version=args.version,
                      verify=args.cacert or True, cert=(args.cert, args.cert_key) if args.cert else None,
                      retries=args.retries, progress=False if args.no_progress else None)  # fmt: skip
    except (PushError, TokenFileError, SignatureError, ManifestError, OSError, ValueError) as exc:
        print(f"hotswap push: {exc}", file=sys.stderr)
        return 1
    print(f"pushed {answer.get('version')}: {answer.get('status')} ({answer.get('digest')})")
    return 0
