"""Reference worker: model, scheduler, serving API, admin API (see daemon.worker.server)."""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.worker.server import main

__all__ = ["main"]

__getattr__ = public_face(__name__)
