"""Tokenizers at the edges (issue 36, item 2):

- the docs' recipes (README, getting started, publish) make a checkpoint with a tokenizer, so a
  worker launched on its own folder answers text prompts;
- compat says (warns, or with `checks.keep_tokenizer` rejects) when a version drops the tokenizer
  that the serving version has;
- with real processes: a version without a tokenizer serves after one with, the worker is
  SIGKILLed and relaunched on the version's own folder, and refuses text (400 no_tokenizer):
  `/health` names it (`serving_without_tokenizer`), it is not green in silence.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import REPO, DaemonProcess, wait_until
from support_managed import close_managed, managed_daemon
from support_rollout import aliases, publish_into

from daemon.checks.base import CheckContext, CheckFailed, CheckSettings
from daemon.checks.compat import check_compat, has_tokenizer
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(600)
RECIPE = re.compile(r'^python -c "(from daemon\.tinymodel import make_tiny_checkpoint[^"]*)"$', re.M)


def test_the_docs_recipes_make_a_checkpoint_with_a_tokenizer(tmp_path: Path) -> None:
    found = 0
    for page in (REPO / "README.md", REPO / "docs" / "getting-started.md", REPO / "docs" / "how-to" / "publish.md"):
        for i, code in enumerate(RECIPE.findall(page.read_text())):
            cwd = tmp_path / f"{page.stem}-{i}"
            cwd.mkdir()
            subprocess.run([sys.executable, "-c", code], cwd=cwd, check=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
            made = next(p for p in (cwd / "checkpoints").iterdir() if p.is_dir())
            assert has_tokenizer(made), f"{page.name}: `{code}` makes {made} without a tokenizer"
            found += 1
    assert found >= 3


def test_compat_warns_or_refuses_when_a_version_drops_the_tokenizer(tmp_path: Path) -> None:
    serving = make_tiny_checkpoint(tmp_path / "serving", seed=0, tokenizer=True)
    bare = make_tiny_checkpoint(tmp_path / "bare", seed=1)
    kept = make_tiny_checkpoint(tmp_path / "kept", seed=2, tokenizer=True)
    detail = check_compat(CheckContext(Path(bare), CheckSettings(), Path(serving)))
    assert detail["tokenizer_dropped"] is True and "400 no_tokenizer" in detail["warning"], detail
    assert "tokenizer_dropped" not in check_compat(CheckContext(Path(kept), CheckSettings(), Path(serving)))
    with pytest.raises(CheckFailed, match="has no tokenizer .* checks.keep_tokenizer = true rejects it"):
        check_compat(CheckContext(Path(bare), CheckSettings(keep_tokenizer=True), Path(serving)))
    # the other way round (a tokenizer added) is nothing to say
    assert "tokenizer_dropped" not in check_compat(CheckContext(Path(kept), CheckSettings(), Path(bare)))


@pytest.fixture
def started() -> Iterator[list[DaemonProcess]]:
    out: list[DaemonProcess] = []
    yield out
    for d in out:
        close_managed(d)


def test_a_serving_version_that_cannot_take_text_is_a_problem(tmp_path: Path, started: Any) -> None:
    d = managed_daemon(tmp_path, started, None, checks={"enabled": ["manifest", "headers", "crc32c", "compat"]})
    runtime = d.state_dir / "worker-local.json"
    wait_until(lambda: aliases(d.registry).get("serving") == "tiny-seed", 120, 0.2, "the seed serving")
    publish_into(d.watch_dir, "v1", seed=1)  # made without a tokenizer (the seed has one)
    wait_until(lambda: aliases(d.registry).get("last_good") == "v1", 180, 0.2, "v1 deployed")
    url = f"http://127.0.0.1:{json.loads(runtime.read_text())['port']}"
    body = {"prompt": "Hello", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200  # the seed's tokenizer
    problems = wait_until(lambda: [p for p in d.get("/health").json().get("problems", [])
                                   if p["kind"] == "serving_without_tokenizer"] or None, 60, 0.2,
                          "serving_without_tokenizer in /health")  # fmt: skip
    assert problems[0]["subject"] == "v1" and "400 no_tokenizer" in problems[0]["reason"], problems
    with d.registry.session() as s:
        from daemon.registry import queries as q

        ckpt = q.get_checkpoint(s, "v1")
        assert ckpt is not None
        compat = next(c for c in q.checks_of(s, ckpt.id) if c.name == "compat")
        assert compat.ok and (compat.detail or {}).get("tokenizer_dropped") is True, compat.detail

    pid = json.loads(runtime.read_text())["pid"]
    os.kill(pid, signal.SIGKILL)  # relaunched on v1's own folder: no tokenizer there
    wait_until(lambda: json.loads(runtime.read_text())["pid"] != pid
               and httpx.get(f"{url}/v1/models", timeout=5).status_code == 200, 180, 0.2, "the relaunch")  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer", r.text
    assert any(p["kind"] == "serving_without_tokenizer" for p in d.get("/health").json().get("problems", []))
