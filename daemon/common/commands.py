"""Restart commands that would run a shell: `shell_of(argv)` names the shell a
command's first word runs, directly or through `env`, so config loading can refuse it. A worker's
`restart_command` is run without a shell with `{version}` and `{path}` filled in per argument; a
shell wrapper (`sh -c "systemctl restart vllm@{version}"`) would make a checkpoint's name code.
"""

from __future__ import annotations

import posixpath

# shells, whose `-c` argument is code; a program of your own (a Python script, say) is run as itself
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "csh", "tcsh", "fish", "busybox", "rbash",
                    "pwsh", "yash", "oksh", "loksh"})  # fmt: skip


def shell_of(argv: list[str]) -> str | None:
    """The shell a restart command's first word runs, directly or through `env` (or None)."""
    words = list(argv)
    while words:
        word = posixpath.basename(words[0])
        if word != "env":
            return word if word in SHELLS else None
        words = words[1:]
        while words and (words[0].startswith("-") or "=" in words[0]):  # env's options and VAR=value
            words = words[1:]
    return None
