"""The one error of daemon.delta, in a module of its own: sources and the command line catch it
without importing numpy (the codec's)."""

from __future__ import annotations


class DeltaError(ValueError):
    """A delta that cannot be applied: the message names the file, the chunk and the problem."""
