"""A stand-in for daemon.transport.ipc_verify.Premap in the check process's protocol tests: it
touches `opened` in its folder when the child unpickles it and `discarded` when told to let go."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Marker:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __reduce__(self) -> tuple[Any, ...]:
        return (_opened, (self.directory,))

    def discard(self) -> None:
        (Path(self.directory) / "discarded").touch()


def _opened(directory: str) -> Marker:
    (Path(directory) / "opened").touch()  # a folder that is not there: unpickling fails, as an open can
    return Marker(directory)
