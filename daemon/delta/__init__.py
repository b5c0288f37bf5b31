"""Delta checkpoints: a version shipped as what changed since a base version, rebuilt bit-identical.

    codec.py      one chunk: unchanged, sparse (indices + values), XOR + zstd, or full; bounded decoding
    container.py  one delta file (`*.hsd`): the chunks that rebuild one result file from its base file
    section.py    the manifest's `delta` section: the base (version + content digest), the delta files
    build.py      the trainer side: encode a new checkpoint against a base, write the delta and manifest
    anchors.py    when the trainer ships a full checkpoint (an anchor) instead of a delta
    rebuild.py    the host side: a delta + its verified base -> a full version directory, atomically
    errors.py     DeltaError (light: sources and the command line catch it without numpy)

A delta's manifest lists the *result* files exactly as a full manifest does (bytes, CRC32C,
strong hash), so the signature and every check protect what is served; the delta files are
listed, with their own hashes, in the signed `delta` section. Pure functions of bytes and paths.
"""

from typing import TYPE_CHECKING

from daemon import public_face
from daemon.delta.errors import DeltaError

if TYPE_CHECKING:
    from daemon.delta.anchors import AnchorRule
    from daemon.delta.build import publish_delta
    from daemon.delta.rebuild import rebuild_delta, reusable_size
    from daemon.delta.section import BaseMissing, DeltaSpec, fetched_files, is_delta, parse, shipped_files

__all__ = [
    "AnchorRule", "BaseMissing", "DeltaError", "DeltaSpec", "fetched_files", "is_delta", "parse",
    "publish_delta", "rebuild_delta", "reusable_size", "shipped_files"
]

__getattr__ = public_face(__name__)
