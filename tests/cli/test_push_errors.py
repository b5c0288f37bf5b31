"""What `hotswap push` says when it cannot push: the real cause in one line, against a real push
listener (its own uvicorn, TLS with client certificates from a throwaway CA), never a generic
"daemon unreachable" for a problem that trying again cannot fix."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import publish_tiny
from support_tls import Pki

from daemon.cli.push import push_main
from daemon.sources.push import PushSource, PushSourceConfig

pytestmark = pytest.mark.quick

TOKEN = "push-token-0123456789"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Pki, str, str]]:
    root = tmp_path_factory.mktemp("push-errors")
    (root / "token").write_text(TOKEN + "\n")
    (root / "wrong.token").write_text("not-the-token\n")
    (root / "hmac.key").write_bytes(os.urandom(32).hex().encode())
    pki = Pki(root / "pki")
    started = []
    urls = []
    for tls in (False, True):
        extra = {"tls_cert_file": pki.server[0], "tls_key_file": pki.server[1], "tls_client_ca_file": pki.ca} if tls else {}
        cfg = PushSourceConfig(path=str(root / f"registry-{tls}"), token_file=str(root / "token"),
                               listen="127.0.0.1:0", hmac_keys={"trainer": str(root / "hmac.key")}, **extra)  # fmt: skip
        cfg.validate("sources[0]")
        src = PushSource(cfg, lambda item: 1)
        src.start()
        started.append(src)
        assert src.server is not None
        urls.append(src.server.url)
    publish_tiny(root / "ckpt", seed=2)
    yield root, pki, urls[0], urls[1]
    for s in started:
        s.stop()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = push_main([*argv, "--no-progress", "--retries", "1"])
    return code, capsys.readouterr().err


def test_a_wrong_token_names_the_push_source_token_file(setup, capsys) -> None:
    root, _, plain, _ = setup
    code, err = run(capsys, str(root / "ckpt"), "--to", plain, "--token-file", str(root / "wrong.token"),
                    "--key-file", str(root / "hmac.key"), "--key-id", "trainer")  # fmt: skip
    assert code == 1 and "401" in err
    assert "push source's token_file" in err and "control.token is for its control API" in err


def test_the_daemon_api_port_is_named_as_the_wrong_address(setup, capsys, tmp_path) -> None:
    root, _, plain, _ = setup
    code, err = run(capsys, str(root / "ckpt"), "--to", plain + "/not-here", "--token-file", str(root / "token"),
                    "--key-file", str(root / "hmac.key"), "--key-id", "trainer")  # fmt: skip
    assert code == 1 and "404" in err and "push source's listen address" in err


def test_a_missing_client_certificate_says_so(setup, capsys) -> None:
    root, pki, _, tls = setup
    code, err = run(capsys, str(root / "ckpt"), "--to", tls, "--token-file", str(root / "token"),
                    "--key-file", str(root / "hmac.key"), "--key-id", "trainer", "--cacert", pki.ca)  # fmt: skip
    assert code == 1
    assert "requires a client certificate" in err and "--cert and --cert-key" in err
    assert "unreachable" not in err


def test_an_untrusted_server_certificate_says_so(setup, capsys) -> None:
    root, pki, _, tls = setup
    code, err = run(capsys, str(root / "ckpt"), "--to", tls, "--token-file", str(root / "token"),
                    "--key-file", str(root / "hmac.key"), "--key-id", "trainer",
                    "--cert", pki.client[0], "--cert-key", pki.client[1])  # fmt: skip
    assert code == 1
    assert "TLS certificate is not trusted" in err and "--cacert" in err and "unreachable" not in err


def test_a_client_certificate_from_another_ca_is_named(setup, capsys) -> None:
    root, pki, _, tls = setup
    code, err = run(capsys, str(root / "ckpt"), "--to", tls, "--token-file", str(root / "token"),
                    "--key-file", str(root / "hmac.key"), "--key-id", "trainer", "--cacert", pki.ca,
                    "--cert", pki.rogue[0], "--cert-key", pki.rogue[1])  # fmt: skip
    assert code == 1
    assert "does not accept this client certificate" in err and "unreachable" not in err


def test_the_right_credentials_push(setup, capsys) -> None:
    root, pki, _, tls = setup
    code = push_main([str(root / "ckpt"), "--to", tls, "--token-file", str(root / "token"), "--no-progress",
                      "--key-file", str(root / "hmac.key"), "--key-id", "trainer", "--cacert", pki.ca,
                      "--cert", pki.client[0], "--cert-key", pki.client[1]])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "committed" in out.out
