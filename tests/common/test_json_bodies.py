"""Deeply nested and malformed JSON bodies are 4xx, never 500: the shared parser and a real worker.

`json.loads` raises RecursionError (not ValueError) on deep nesting, which handlers that catch
ValueError turned into 500s. The daemon's routes are covered against a real daemon in
test_control_api.py; here the parser itself and the reference worker's admin and serving routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support_worker import WorkerProcess, start_worker, write_token

from daemon.common.jsonbody import MAX_DEPTH, JsonBodyError, depth, parse_object
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = [pytest.mark.timeout(300), pytest.mark.quick]

DEEP = b"[" * 50_000 + b"]" * 50_000  # past the interpreter's recursion limit
DEEP_OBJECT = b'{"a": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_001
UNDER_LIMIT = b'{"version": ' + b"[" * 900 + b"]" * 900 + b"}"  # json parses it; anything walking it may not


def test_parse_object_refuses_what_json_cannot_or_should_not_parse() -> None:
    assert parse_object(b"") == {} and parse_object(b"  \n") == {}
    assert parse_object(b'{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    nested_ok = b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert depth(parse_object(nested_ok), MAX_DEPTH) == MAX_DEPTH
    for raw, words in [
        (DEEP, "nested deeper than 64"),
        (DEEP_OBJECT, "nested deeper than 64"),
        (UNDER_LIMIT, "nested deeper than 64"),
        (b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", "nested deeper than 64"),
        (b"{", "not valid JSON"),
        (b'{"a": Infinity}', "not valid JSON"),
        (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON"),  # longer than int() converts
        (b"\xc3\x28", "not UTF-8"),
        (b"[]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
    ]:
        with pytest.raises(JsonBodyError, match=words) as err:
            parse_object(raw)
        assert err.value.status == 400


@pytest.fixture(scope="module")
def w(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    root: Path = tmp_path_factory.mktemp("bodies")
    make_tiny_checkpoint(root / "m", seed=3, tokenizer=True)
    proc = start_worker(root / "m", write_token(root))
    yield proc
    proc.stop()


def test_worker_routes_answer_bad_json_with_4xx(w: WorkerProcess) -> None:
    before = w.greedy([5, 6, 7], max_tokens=4)
    admin = ["/admin/update", "/admin/drain", "/admin/pause", "/admin/probe"]  # the routes that read a body
    for raw in (DEEP, DEEP_OBJECT, UNDER_LIMIT, b"{", b"[1]"):
        with w.client as c:
            for route in admin:
                r = c.post(route, content=raw, headers={**w.auth(), "Content-Type": "application/json"})
                assert r.status_code == 400, (route, raw[:20], r.status_code, r.text[:200])
                assert "error" in r.json()
                unauth = c.post(route, content=raw, headers={"Content-Type": "application/json"})
                assert unauth.status_code == 401, (route, unauth.status_code)
            for route in ("/v1/completions", "/v1/chat/completions"):
                r = c.post(route, content=raw, headers={"Content-Type": "application/json"})
                assert 400 <= r.status_code < 500, (route, raw[:20], r.status_code, r.text[:200])
    info = w.info()
    assert info["state"] == "RUNNING" and info["requests_failed"] == 0
    assert w.greedy([5, 6, 7], max_tokens=4) == before  # nothing changed, still serving
