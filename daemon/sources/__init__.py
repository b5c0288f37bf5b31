"""Checkpoint sources: where committed checkpoints come from (local folders; S3 and push later)."""

from daemon.sources.commit import CommitDetector, Decision, DiscoveredCheckpoint

__all__ = ["CommitDetector", "Decision", "DiscoveredCheckpoint"]
