"""When the trainer ships a full checkpoint (an anchor) instead of a delta.

A host that joins late, or lost its copy of a base, rebuilds from the last anchor plus every
delta since; the longer the chain, the more it fetches. The rule is one of:

* every N versions (`every = N`): a full checkpoint after N - 1 deltas;
* adaptive (the default, `every = 0`): a full checkpoint once the chain's delta bytes since the
  last anchor, this delta included, would pass `share` of a full checkpoint. A chain never costs
  a late host more than about (1 + share) full checkpoints, and a run whose steps change little
  ships few anchors.

A delta that is not smaller than the full files is never shipped: that version is an anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class AnchorRule:
    every: int = 0  # a full checkpoint every N versions; 0: adaptive
    share: float = DEFAULT_SHARE  # adaptive: the chain's delta bytes, as a share of a full checkpoint

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"anchor every must be >= 0, got {self.every}")
        if not self.share > 0:
            raise ValueError(f"anchor share must be > 0, got {self.share}")

    def full_now(self, chain_length: int, chain_bytes: int, delta_bytes: int, full_bytes: int) -> str | None:
        """Why this version must be a full checkpoint, or None to ship the delta.

        `chain_length`, `chain_bytes`: deltas and their bytes since the last anchor, before this one."""
        if delta_bytes >= full_bytes:
            return f"the delta ({delta_bytes} bytes) is not smaller than the full files ({full_bytes})"
        if self.every:
            if chain_length + 1 >= self.every:
                return f"every {self.every} versions a full checkpoint ({chain_length} deltas since the last)"
            return None
        if chain_bytes + delta_bytes > self.share * full_bytes:
            return (f"the chain since the last anchor would reach {chain_bytes + delta_bytes} delta bytes, over "
                    f"{self.share:g} of a full checkpoint ({full_bytes} bytes)")  # fmt: skip
        return None
