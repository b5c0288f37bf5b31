"""The one byte pipeline: every file read of a checkpoint's bytes, read once, fed to sinks.

`engine` (reader threads, a bounded pool of reused buffers, pinned when a device copy follows),
`sinks` (CRC32C, strong hashes in file order, the load check, device copies, a file writer),
`files` (`hash_files`: digests of whole files), `staged` (`stage_files`: one read into a flat
staging copy on a device, hashed on the way), `check` and `expect` (what a read is compared
with: the registry's per-file digests). The shapes the checks read (`Staged`, `VerifyStager`)
are declared in `daemon.checks.base`, so the pipeline imports nothing above the manifest. Its users: `daemon.hashing`'s callers, the checks, the disk transport's reads and
the loader's staging. Nothing here knows a version's history, a worker or the registry.

Nothing is imported here eagerly (`daemon.manifest` imports `files`, and `staged` needs torch):
each name of `__all__` is imported from its module on first use (`daemon.public_face`).
"""

from typing import TYPE_CHECKING

from daemon import public_face

if TYPE_CHECKING:
    from daemon.bytepipe.check import (
        DigestMismatch,
        LoadCheck,
        OrderedHasher,
        Reference,
        ensure_contained,
        is_aborted,
        wants_check,
    )
    from daemon.bytepipe.engine import Buffer, BufferPool, Job, OpenFiles, Sink, pread_exact, run
    from daemon.bytepipe.expect import BadUpdateRequest, Expect, ExpectedFile, reference_for
    from daemon.bytepipe.files import crc32c_file, hash_files
    from daemon.bytepipe.sinks import Checked, Crcs, DeviceCopy, InOrder
    from daemon.bytepipe.staged import StagedTensors, stage_files, typed

__all__ = [
    "BadUpdateRequest", "Buffer", "BufferPool", "Checked", "Crcs", "DeviceCopy", "DigestMismatch",
    "Expect", "ExpectedFile", "InOrder", "Job", "LoadCheck", "OpenFiles", "OrderedHasher", "Reference",
    "Sink", "StagedTensors", "crc32c_file", "ensure_contained", "hash_files", "is_aborted", "pread_exact",
    "reference_for", "run", "stage_files", "typed", "wants_check"
]

__getattr__ = public_face(__name__)
