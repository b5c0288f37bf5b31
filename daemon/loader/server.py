"""`hotswap loader`: the staging process that holds verified versions in GPU (or shared host) memory.

    hotswap loader --socket /run/hotswap/loader.sock [--device cuda|cuda:N|GPU-uuid|cpu ...]
                   [--budget-bytes N] [--max-versions 3] [--shm-dir /dev/shm] [--threads 8]

It listens on a Unix socket (mode 0600) for line-delimited JSON requests (see
`daemon.handoff.loader_protocol`); `daemon.handoff.loader_client.LoaderClient` is the client. SIGTERM or
SIGINT frees every staged version, removes the socket and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import socketserver
import stat
import threading
from pathlib import Path
from typing import Any

from daemon.formats import HeaderError, LayoutError
from daemon.handoff import MAX_REQUEST_BYTES, OPS, ProtocolError, ShmError, decode, encode, read_line
from daemon.loader.staging import StagingError
from daemon.loader.store import Backend, CudaBackend, LoaderStore, ShmBackend, StoreError

log = logging.getLogger("hotswap.loader")

# op -> {argument: (type, required)}
_ARGS: dict[str, dict[str, tuple[type, bool]]] = {
    "stage": {"version": (str, True), "path": (str, True), "digest": (str, False), "files": (list, False),
              "verify_alg": (str, False)},
    "descriptor": {"version": (str, True), "device": (str, False), "purpose": (str, False)},
    "verified": {"version": (str, True), "files": (list, True), "digest": (str, False)},
    "acquire": {"version": (str, True), "worker": (str, True), "pid": (int, False)},
    "release": {"version": (str, True), "worker": (str, True)},
    "drop": {"version": (str, True)},
    "status": {},
}
_EXPECTED = (StoreError, LayoutError, HeaderError, StagingError, ShmError, OSError)


def dispatch(store: LoaderStore, request: dict[str, Any]) -> dict[str, Any]:
    """Validate one request and run it; always returns a response object (never raises)."""
    rid = request.get("id")
    op = request.get("op")
    if op not in OPS:
        return {"ok": False, "id": rid, "error": f"unknown op {op!r}; ops are {', '.join(OPS)}"}
    spec = _ARGS[op]
    args = {k: v for k, v in request.items() if k not in ("op", "id")}
    unknown = sorted(set(args) - set(spec))
    if unknown:
        return {"ok": False, "id": rid, "error": f"{op}: unknown arguments {unknown}"}
    for name, (typ, required) in spec.items():
        if name not in args:
            if required:
                return {"ok": False, "id": rid, "error": f"{op}: missing argument {name!r}"}
            continue
        value = args[name]
        if not isinstance(value, typ) or isinstance(value, bool):
            return {"ok": False, "id": rid, "error": f"{op}: {name} must be {typ.__name__}"}
    try:
        result = getattr(store, op)(**args)
    except _EXPECTED as exc:
        return {"ok": False, "id": rid, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loader
        log.exception("loader %s failed", op)
        return {"ok": False, "id": rid, "error": f"internal error in {op}: {type(exc).__name__}: {exc}"}
    return {"ok": True, "id": rid, "result": result}


class _Handler(socketserver.BaseRequestHandler):
    server: LoaderServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        buf = bytearray()
        while True:
            try:
                line = read_line(sock, buf, MAX_REQUEST_BYTES)
            except ProtocolError as exc:
                sock.sendall(encode({"ok": False, "id": None, "error": str(exc)}))
                return
            except OSError:
                return
            if line is None:
                return
            try:
                response = dispatch(self.server.store, decode(line))
            except ProtocolError as exc:
                response = {"ok": False, "id": None, "error": str(exc)}
            try:
                sock.sendall(encode(response))
            except OSError:
                return


class LoaderServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, store: LoaderStore) -> None:
        self.store = store
        self.path = path
        _clear_stale_socket(path)
        old = os.umask(0o177)  # the socket is born 0600: only the loader's user may connect
        try:
            super().__init__(path, _Handler)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)


def _clear_stale_socket(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SystemExit(f"hotswap loader: {path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # left by a loader that died
        return
    finally:
        probe.close()
    raise SystemExit(f"hotswap loader: another loader is listening on {path}")


def build_backend(devices: list[str], shm_dir: Path, threads: int) -> Backend:
    want_cpu = [d for d in devices if d in ("cpu", "host")]
    if want_cpu and len(want_cpu) != len(devices):
        raise SystemExit("hotswap loader: --device cpu cannot be mixed with GPUs")
    if not want_cpu:
        import torch

        if not torch.cuda.is_available():
            if devices == ["auto"]:
                want_cpu = ["cpu"]
            else:
                raise SystemExit(f"hotswap loader: no CUDA device visible for --device {' '.join(devices)}")
    if want_cpu:
        if not shm_dir.is_dir():
            raise SystemExit(f"hotswap loader: --shm-dir {shm_dir} is not a directory")
        backend = ShmBackend(shm_dir, threads)
        removed = backend.cleanup_stale()
        if removed:
            log.info("removed %d stale segments from dead loaders: %s", len(removed), ", ".join(removed))
        return backend
    from daemon.handoff import device_index

    indices: list[int] = []
    for d in devices:
        if d in ("auto", "cuda"):
            indices += range(torch.cuda.device_count())
        elif d.startswith("GPU-"):
            indices.append(device_index(d))
        elif d.removeprefix("cuda:").isdigit():
            indices.append(int(d.removeprefix("cuda:")))
        else:
            raise SystemExit(f"hotswap loader: bad --device {d!r} (cpu, cuda, cuda:N or GPU-<uuid>)")
    indices = sorted(set(indices))
    bad = [i for i in indices if i >= torch.cuda.device_count()]
    if bad:
        raise SystemExit(f"hotswap loader: no CUDA device {bad[0]} (have {torch.cuda.device_count()})")
    return CudaBackend(indices, threads)


def _configure_logging(level: str) -> None:
    try:
        from daemon.common import configure_logging

        configure_logging(level)
    except ImportError:  # structlog missing (bare GPU box): plain logging will do
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hotswap loader", description="Stage verified versions for ipc updates.")
    p.add_argument("--socket", required=True, help="Unix socket path to listen on (created 0600)")
    p.add_argument("--device", action="append", help="cpu, cuda (all GPUs), cuda:N or GPU-<uuid>; repeatable")
    p.add_argument("--budget-bytes", type=int, default=None, help="per-device staging budget in bytes")
    p.add_argument("--max-versions", type=int, default=3, help="versions resident at most (serving, last good, incoming)")
    p.add_argument("--shm-dir", default="/dev/shm", help="directory for shared-memory segments (cpu)")
    p.add_argument("--threads", type=int, default=8, help="reader threads while staging")
    p.add_argument("--log-level", default="info", help="debug | info | warning | error")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _configure_logging(args.log_level)
    if args.budget_bytes is not None and args.budget_bytes <= 0:
        raise SystemExit("hotswap loader: --budget-bytes must be positive")
    backend = build_backend(args.device or ["auto"], Path(args.shm_dir), max(1, args.threads))
    socket_path = os.path.abspath(args.socket)
    store = LoaderStore(
        backend, budget_bytes=args.budget_bytes, max_versions=args.max_versions, socket_path=socket_path
    )
    server = LoaderServer(socket_path, store)

    def stop(signum: int, _frame: Any) -> None:
        log.info("loader stopping on signal %d", signum)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("loader listening on %s (%s: %s)", socket_path, backend.kind, ", ".join(backend.devices))
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        store.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
    log.info("loader stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
