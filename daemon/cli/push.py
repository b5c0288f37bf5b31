"""`hotswap push DIR --to https://host:8781` (`hotswap publish` is daemon.cli.publish).

`push` streams the checkpoint to a daemon's push source, signing the manifest
with `--key-file` (HMAC-SHA256); the token comes from `--token-file` or $HOTSWAP_PUSH_TOKEN.
Exit codes: 0 done, 1 refused or failed (one line on stderr), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from daemon.checks import SignatureError
from daemon.client import PushError, push
from daemon.common import TokenFileError, read_token_file
from daemon.manifest import ManifestError


def push_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hotswap push", description="Stream a checkpoint to a daemon's push source.")
    ap.add_argument("directory", metavar="DIR", type=Path, help="the checkpoint directory (Hugging Face layout)")
    ap.add_argument("--to", required=True, help="the push source's listener ([[sources]] listen), e.g. https://host:8781")
    ap.add_argument("--token-file", type=Path,
                    help="the push source's token_file (not control.token; default: $HOTSWAP_PUSH_TOKEN)")  # fmt: skip
    ap.add_argument("--key-file", type=Path, help="HMAC key that signs the manifest (else it must be signed)")
    ap.add_argument("--key-id", default="default", help="the key's id in the source's hmac_keys (default: default)")
    ap.add_argument("--version", help="version label when the directory has no manifest yet")
    ap.add_argument("--cacert", help="CA bundle that signed the daemon's certificate")
    ap.add_argument("--cert", help="client certificate (mTLS)")
    ap.add_argument("--cert-key", help="client certificate's key (mTLS)")
    ap.add_argument("--retries", type=int, default=3, help="tries again per file after a network error or a 429/5xx")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (the default off a terminal)")
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
