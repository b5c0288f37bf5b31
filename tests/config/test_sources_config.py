"""The s3 and push `[[sources]]` tables: the documented example parses; mistakes name the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from daemon.config import ConfigError, load_config
from daemon.sources.push import PushSourceConfig
from daemon.sources.s3 import S3SourceConfig

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]


def _commented_block(kind: str) -> str:
    """The commented-out `[[sources]]` block of `type = kind` in config.example.toml, uncommented."""
    text = (REPO / "config.example.toml").read_text()
    m = re.search(rf"^# \[\[sources\]\]\n# type = \"{kind}\"\n(?:# [a-z_0-9]+ = .*\n)+", text, re.M)
    assert m, f"no commented [[sources]] type = {kind!r} block in config.example.toml"
    return "\n".join(line[2:] for line in m.group(0).splitlines()) + "\n"


def test_documented_s3_and_push_examples_parse(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(_commented_block("s3") + _commented_block("push"))
    s3, push = load_config(cfg).sources
    assert isinstance(s3, S3SourceConfig) and s3.bucket == "my-checkpoints" and s3.key_prefix == "runs/llama-8b/"
    assert isinstance(push, PushSourceConfig) and push.hmac_keys == {"trainer-1": "/etc/hotswap/trainer-1.key"}
    for f in ("bucket", "prefix", "endpoint_url", "poll_interval_s", "sqs_queue_url", "concurrency", "cache_dir",
              "cache_max_bytes"):  # fmt: skip
        assert f in _commented_block("s3")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('type = "s3"\nbucket = "a/b"', "sources[0].bucket: must be a bucket name"),
        ('type = "s3"\nbucket = "b"\nconcurrency = 0', "sources[0].concurrency"),
        ('type = "s3"\nbucket = "b"\npoll_interval_s = 0', "sources[0].poll_interval_s: must be > 0"),
        ('type = "push"\npath = "p"\ntoken_file = "t"', "sources[0].hmac_keys: a push is accepted only with a signed"),
        ('type = "push"\npath = "p"\ntoken_file = "t"\nhmac_keys = {k = "f"}\nlisten = "nope"', "sources[0].listen"),
        ('type = "push"\npath = "p"\ntoken_file = "t"\nhmac_keys = {k = "f"}\nlisten = "0.0.0.0:8781"',
         "sources[0].listen: 0.0.0.0:8781 is not loopback and there is no TLS"),
        ('type = "push"\npath = "p"\ntoken_file = "t"\nhmac_keys = {k = "f"}\ntls_client_ca_file = "ca"',
         "sources[0].tls_client_ca_file: client certificates need TLS"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line_naming_the_key(tmp_path, table, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[[sources]]\n{table}\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
