"""What the command line and the daemon both name before any config file is read: the config
file's environment variable and the log levels. A leaf, so `hotswap --version` and the argument
parser import nothing heavy (daemon.config re-exports both)."""

from __future__ import annotations

CONFIG_ENV = "HOTSWAP_CONFIG"
LOG_LEVELS = ("debug", "info", "warning", "error")
