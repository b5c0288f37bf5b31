"""Which function runs each check, for a full checkpoint or a LoRA adapter (read by the runner and
by the check process, daemon.checks.isolation)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from daemon.checks.base import CHECK_NAMES, CheckContext

# check name -> "module:function"; imported on first use so cheap checks never pay for torch
_CHECKS: dict[str, str] = {
    "manifest": "daemon.checks.completeness:check_manifest",
    "headers": "daemon.checks.headers:check_headers",
    "crc32c": "daemon.checks.integrity:check_crc32c",
    "compat": "daemon.checks.compat:check_compat",
    "finite": "daemon.checks.finite:check_finite",
    "headroom": "daemon.checks.headroom:check_headroom",
    "forward": "daemon.checks.forward:check_forward",
}
assert tuple(_CHECKS) == CHECK_NAMES
# A LoRA adapter checkpoint (daemon.formats.adapter) is checked against the serving base instead
_ADAPTER_CHECKS: dict[str, str] = {
    "compat": "daemon.checks.adapter:check_adapter_compat",
    "forward": "daemon.checks.adapter:check_adapter_forward",
}

CheckFn = Callable[[CheckContext], dict[str, Any]]


def resolve(name: str, adapter: bool = False) -> CheckFn:
    module, func = (_ADAPTER_CHECKS if adapter and name in _ADAPTER_CHECKS else _CHECKS)[name].split(":")
    fn: CheckFn = getattr(importlib.import_module(module), func)
    return fn
