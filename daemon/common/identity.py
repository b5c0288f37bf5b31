"""Who is on the other end of a worker's admin API: private sockets, per-launch secrets, proofs.

Managed workers serve their admin API on a Unix socket in a directory only the daemon's user
can enter (0700, socket 0600), so no other local user can connect to it, squat it or read what
goes over it. A worker reached over TCP is asked to prove it holds the launch secret before the
daemon sends it anything secret:

    daemon -> worker   POST /admin/identify {"nonce": <32 random bytes, hex>}     (no token)
    worker -> daemon   {"proof": hex(HMAC-SHA256(secret, DOMAIN || nonce))}

The daemon compares the proof in constant time and sends the bearer token only on success. The
secret is the worker's token itself (the HMAC key, never sent to an unverified peer); managed
workers get a fresh one at every launch, written 0600 under the state dir (never on a command
line). `DOMAIN` keeps the proof from being usable as anything else.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from daemon.common.private import write_private

DOMAIN = b"hotswap-worker-identity/1\n"
NONCE_BYTES = 32
MAX_NONCE_HEX = 256
SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


class PrivateDirError(RuntimeError):
    """A directory meant to be private is not (wrong owner, or open to group/others)."""


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def proof(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, DOMAIN + nonce.encode("ascii"), hashlib.sha256).hexdigest()


def proof_ok(secret: bytes, nonce: str, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), proof(secret, nonce).encode())


def valid_nonce(nonce: object) -> bool:
    return (isinstance(nonce, str) and 32 <= len(nonce) <= MAX_NONCE_HEX
            and all(c in "0123456789abcdef" for c in nonce))  # fmt: skip


def private_dir(path: Path) -> Path:
    """Create `path` (0700) if missing; refuse one owned by someone else or open to others."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"{path}: not a directory")
    if st.st_uid != os.getuid():
        raise PrivateDirError(f"{path}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def check_private_socket_dir(socket_path: Path) -> None:
    """The worker side: the socket's directory must be ours and closed to group/others."""
    parent = socket_path.parent
    try:
        st = os.lstat(parent)
    except FileNotFoundError:
        raise PrivateDirError(f"{parent}: does not exist (the daemon creates it 0700)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"{parent}: not a directory")
    if st.st_uid != os.getuid():
        raise PrivateDirError(f"{parent}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise PrivateDirError(f"{parent}: mode {st.st_mode & 0o777:o} lets other users in; it must be 0700")


def socket_dir(state_dir: Path) -> Path:
    """Where managed workers' admin sockets live: `<state_dir>/run`, or, when that path is too
    long for a socket name, a private `/tmp/hotswap-<uid>-<hash>` (created 0700, checked)."""
    run = Path(state_dir).resolve() / "run"
    if len(str(run)) + 40 <= SOCKET_PATH_MAX:
        return private_dir(run)
    tag = hashlib.sha256(str(run).encode()).hexdigest()[:12]
    return private_dir(Path("/tmp") / f"hotswap-{os.getuid()}-{tag}")


def write_secret(path: Path) -> str:
    """A fresh secret in `path` (0600, replaced atomically); returns it."""
    value = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, (value + "\n").encode())
    return value
