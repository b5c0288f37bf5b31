"""The eval gate: a user command (argv, never a shell) scores the version on the canary's worker.

The command runs with a small environment: PATH, HOME, LANG, TMPDIR from the daemon's, the gate's
`env`, and HOTSWAP_WORKER_URL (the first worker's serving URL), HOTSWAP_WORKER_URLS (all, space
separated), HOTSWAP_VERSION, HOTSWAP_VERSION_DIR (its folder), HOTSWAP_HOST; nothing else of the
daemon's environment (its credentials) reaches it. Its last stdout line is the score: a JSON
number or an object with "score". The gate passes when it exits 0 and the score meets every bound
given: `min_score` (absolute) and `max_drop` (relative to the score this gate recorded as passed
on the host's last good version; the first version with no such score is held to `min_score`
alone, and passes when that is all it could be held to). A command still running at `timeout_s`
is killed with its whole process group and fails; one that cannot start (missing, not
executable) is an error: the gate could not run. The last `output_cap` bytes of stdout and of
stderr are kept in the gate run's row.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from typing import IO

from daemon.gates.base import Measurement, Trial
from daemon.gates.settings import GateSpec

PASSED_ON = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")


@dataclass
class EvalGate:
    spec: GateSpec

    def measure(self, trial: Trial) -> list[Measurement]:
        return [self._run(trial)]

    def environment(self, trial: Trial) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSED_ON if k in os.environ}
        env.update(self.spec.env)
        urls = [u for _, u in trial.workers]
        env.update(HOTSWAP_WORKER_URL=urls[0] if urls else "", HOTSWAP_WORKER_URLS=" ".join(urls),
                   HOTSWAP_VERSION=trial.version, HOTSWAP_VERSION_DIR=trial.version_dir, HOTSWAP_HOST=trial.host)  # fmt: skip
        return env

    def _run(self, trial: Trial) -> Measurement:
        spec = self.spec
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(spec.command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        env=self.environment(trial), start_new_session=True)  # fmt: skip
            except OSError as exc:
                return Measurement(
                    "error", None, "", f"command {spec.command[0]!r} could not start: {exc.strerror or exc}"
                )
            try:
                code: int | None = proc.wait(timeout=spec.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = None
            tails = f"stdout:\n{_tail(out, spec.output_cap)}\nstderr:\n{_tail(err, spec.output_cap)}"
            stdout = _tail(out, spec.output_cap)
        if code is None:
            return Measurement(
                "failed", None, "", f"killed at its timeout ({spec.timeout_s:g} s)", output=tails
            )
        score = _score(stdout)
        bound, cond = self._bound(trial)
        if code != 0:
            return Measurement("failed", score, cond, f"exited with status {code}", output=tails)
        if score is None:
            return Measurement("failed", None, cond, "no score on stdout (its last line: a JSON number or "
                               "{\"score\": ...})", output=tails)  # fmt: skip
        if bound is not None and score < bound:
            return Measurement("failed", score, cond, f"score {score:g} is below {cond}", output=tails)
        return Measurement("passed", score, cond, f"score {score:g} meets {cond or 'no bound'}", output=tails)

    def _bound(self, trial: Trial) -> tuple[float | None, str]:
        """The lowest passing score and how it was found, in words."""
        bounds: list[tuple[float, str]] = []
        if self.spec.min_score is not None:
            bounds.append((self.spec.min_score, f">= {self.spec.min_score:g}"))
        if self.spec.max_drop is not None and (prev := trial.previous_score(self.spec.name)) is not None:
            v, s = prev
            bounds.append((s - self.spec.max_drop, f">= {s - self.spec.max_drop:g} (last good {v} scored {s:g}, "
                                                   f"max_drop {self.spec.max_drop:g})"))  # fmt: skip
        if not bounds:
            return None, "no last good score yet"
        return max(bounds)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """The command and whatever it started: a hung eval may have children holding its pipes."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(f: IO[bytes], cap: int) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - cap))
    return f.read(cap).decode("utf-8", "replace")


def _score(stdout: str) -> float | None:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        doc = json.loads(lines[-1])
    except ValueError:
        return None
    if isinstance(doc, dict):
        doc = doc.get("score")
    if isinstance(doc, bool) or not isinstance(doc, int | float):
        return None
    return float(doc)
