"""Names a checkpoint brings with it: its version label and its files' relative paths.

    version_problem(label) -> why it cannot be a label (one line), or None
    check_version_label(label, where) -> label, or ManifestError naming the problem
    check_relative_path(path, root) -> path, or ManifestError naming the problem

Both become names on disk (`<path>/<version>/`, `<cache>/<version>/<file>`) and a version label
also goes into the registry, every log line of its checkpoint and workers' responses, so the rules
are the filesystem's, the log's and the shell's: a label is at most 200 bytes of `[A-Za-z0-9._@+-]`,
not starting with "." (folders being assembled are ".partial-..." and ".incoming") or "-" (an
option to any command it is passed to); labels already in a registry are never re-judged; a path is
relative, normalised, at most 32 levels and 1024 bytes, each component at most 255 bytes. Every
reader (the manifest parser, the push routes, the local and S3 sources) applies the same rules, so
a name is refused with its reason before anything touches the filesystem.
"""

from __future__ import annotations

import posixpath
import unicodedata
from pathlib import Path

VERSION_MAX_BYTES = 200  # one directory name, with room for ".partial-" before it
NAME_MAX_BYTES = 255  # one path component (NAME_MAX on Linux)
PATH_MAX_BYTES = 1024  # a file's relative path inside a checkpoint
PATH_MAX_DEPTH = 32  # folders deep
_LINE_BREAKS = "\n\r\u2028\u2029"
# what a label may hold: it is substituted into restart commands ({version}) and becomes a folder
# name, so no shell metacharacter, space or non-ASCII letter (issue 37: `$(...)`, `;`, `-rf`)
LABEL_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._@+-")


class ManifestError(ValueError):
    """A manifest that is missing, malformed or unsafe; the message names the field or path."""


def version_problem(version: object) -> str | None:
    """Why `version` cannot be a version label, in one line; None when it can.

    A label names a directory (a push folder, an S3 cache folder), a database row and every log
    line of its checkpoint, and goes into workers' responses: one printable path component."""
    if not isinstance(version, str) or not version:
        return f"version {version!r} must be a non-empty string"
    try:
        size = len(version.encode("utf-8"))
    except UnicodeEncodeError:
        return f"version {version!r:.80} is not valid UTF-8"
    if size > VERSION_MAX_BYTES:
        return f"version {version!r:.60}... is {size} bytes, over {VERSION_MAX_BYTES}"
    bad = next((c for c in version if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        what = "a NUL byte" if bad == "\x00" else "a newline" if bad in _LINE_BREAKS else "a control character"
        return f"version {version!r:.80} contains {what} ({bad!r})"
    if "/" in version or "\\" in version:
        return f"version {version!r} contains a slash: a label is one folder name"
    if version.startswith("."):
        return f"version {version!r} starts with '.' (reserved for folders being assembled, and '..')"
    if version.startswith("-"):
        return f"version {version!r:.80} starts with '-' (a command it is passed to would read it as an option)"
    bad = "".join(sorted({c for c in version if c not in LABEL_CHARS}))
    if bad:
        return f"version {version!r:.80} contains {bad!r:.40}: a label is letters, digits and . _ @ + - only"
    return None


def check_version_label(version: object, where: str = "") -> str:
    """Return `version` if it is a usable label, else raise ManifestError naming the problem."""
    problem = version_problem(version)
    if problem is not None:
        raise ManifestError(f"{where}: {problem}" if where else problem)
    assert isinstance(version, str)
    return version


def check_relative_path(path: object, root: Path | None = None) -> str:
    """Return `path` if it is a safe relative path inside the checkpoint, else raise ManifestError."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"file path {path!r} must be a non-empty string")
    if "\\" in path or "\x00" in path:
        raise ManifestError(f"file path {path!r:.200} contains a backslash or NUL")
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise ManifestError(f"file path {path!r:.200} is not valid UTF-8") from None
    if path.startswith("/"):
        raise ManifestError(f"file path {path!r:.200} is absolute")
    parts = path.split("/")
    if ".." in parts:
        raise ManifestError(f"file path {path!r:.200} contains '..' (leaves the checkpoint)")
    if len(parts) > PATH_MAX_DEPTH:
        raise ManifestError(f"file path {path[:60]!r}... is {len(parts)} levels deep, over {PATH_MAX_DEPTH}")
    if size > PATH_MAX_BYTES:
        raise ManifestError(f"file path {path[:60]!r}... is {size} bytes, over {PATH_MAX_BYTES}")
    long = next((p for p in parts if len(p.encode("utf-8")) > NAME_MAX_BYTES), None)
    if long is not None:
        raise ManifestError(f"file path {path[:60]!r}...: a component is {len(long.encode())} bytes, "
                            f"over {NAME_MAX_BYTES}")  # fmt: skip
    if posixpath.normpath(path) != path or "." in parts:
        raise ManifestError(f"file path {path!r} is not normalised (expected {posixpath.normpath(path)!r})")
    if root is not None:
        full = root / path
        if full.is_symlink() or any((root / "/".join(parts[:i])).is_symlink() for i in range(1, len(parts))):
            target = full.resolve()
            if not target.is_relative_to(root.resolve()):
                raise ManifestError(f"file path {path!r} is a symlink leaving the checkpoint (-> {target})")
    return path
