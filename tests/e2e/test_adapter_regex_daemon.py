"""A LoRA adapter whose `target_modules` is a backtracking regex cannot freeze the daemon (issue 37,
item 2), with real processes: a daemon, its managed worker serving a tiny base, the adapter
dropped into the watched folder.

`.*q_proj|mod(.+)+X` made compat backtrack for 81 s holding the GIL: `/livez` did not answer for
63 s and the adapter was then deployed. Now the pattern is judged before anything matches it (no
repeated group, a bounded length and number of repetitions): the adapter is rejected naming why,
and `/livez` answers within 1 s throughout. An adapter whose scale (lora_alpha / r) is 2.5e29 is
rejected by compat too (item 7).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, wait_until
from support_adapters import make_adapter, make_base, publish_adapter
from support_engines import publish_ckpt
from support_managed import close_managed, managed_daemon

pytestmark = pytest.mark.timeout(600)

EVIL = ".*q_proj|mod(.+)+X"


def test_a_backtracking_target_modules_regex_is_refused_and_livez_keeps_answering(tmp_path: Path) -> None:
    started: list[DaemonProcess] = []
    watch = tmp_path / "checkpoints"
    base = publish_ckpt(watch, "base-v0", lambda d: make_base(d, seed=0))
    stop = threading.Event()
    slow: list[str] = []

    def probe(url: str) -> None:
        while not stop.wait(0.1):
            try:
                httpx.get(url + "/livez", timeout=1.0).raise_for_status()
            except httpx.HTTPError as exc:
                slow.append(f"{type(exc).__name__}: {exc}")

    try:
        d = managed_daemon(tmp_path, started, model=str(base),
                           checks={"enabled": ["manifest", "headers", "crc32c", "compat"]})
        d.wait_status("base-v0", "deployed", timeout=300)
        assert d.api_url
        t = threading.Thread(target=probe, args=(d.api_url,), daemon=True)
        t.start()

        def evil(directory: Path) -> Path:
            make_adapter(directory, base, seed=1)
            cfg = json.loads((directory / "adapter_config.json").read_text())
            cfg["target_modules"] = EVIL
            (directory / "adapter_config.json").write_text(json.dumps(cfg))
            return directory

        publish_adapter(watch, "sql@1", "sql", evil)
        row = d.wait_status("sql@1", ("rejected", "deployed", "verified"), timeout=300)
        stop.set()
        t.join(10)
        assert row["status"] == "rejected", row
        assert "target_modules" in row["status_message"] and "nested quantifier" in row["status_message"], row
        assert not slow, f"/livez did not answer within 1 s: {slow[:3]}"
        # issue 37, item 7: lora_alpha = 1e30 (scale 2.5e29) passed every check; now compat bounds it
        publish_adapter(watch, "sql@2", "sql", lambda x: make_adapter(x, base, seed=2, alpha=1e30))
        row = d.wait_status("sql@2", ("rejected", "deployed", "verified"), timeout=300)
        assert row["status"] == "rejected" and "checks.adapter_scale_max" in row["status_message"], row
        wait_until(lambda: d.get("/health").status_code == 200, 60, what="/health green: the base still serves")
    finally:
        stop.set()
        for d in started:
            close_managed(d)
