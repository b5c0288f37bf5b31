"""The one byte pipeline: every file read of a checkpoint's bytes, read once, fed to sinks.

`engine` (reader threads, a bounded pool of reused buffers, pinned when a device copy follows),
`sinks` (CRC32C, strong hashes in file order, the load check, device copies, a file writer),
`files` (`hash_files`: digests of whole files), `staged` (`stage_files`: one read into a flat
staging copy on a device, hashed on the way), `check` and `expect` (what a read is compared
with: the registry's per-file digests). The shapes the checks read (`Staged`, `VerifyStager`)
are declared in `daemon.checks.base`, so the pipeline imports nothing above the manifest. Its users: `daemon.hashing`'s callers, the checks, the disk transport's reads and
the loader's staging. Nothing here knows a version's history, a worker or the registry.

Nothing is imported here: `daemon.manifest` imports `files`, and `staged` needs torch.
"""
