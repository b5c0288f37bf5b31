"""The staging loader: `hotswap loader` (server) and the version store; its client and the descriptor it
exports are in `daemon.handoff`, its reads run on the byte pipeline (`daemon.bytepipe`)."""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.loader.server import main

__all__ = ["main"]

__getattr__ = public_face(__name__)
