"""The reference worker through the official `openai` client: models, completions, chat, streaming with
multi-byte text (streamed == non-streamed), penalties and error objects, against real worker processes.

`w` serves the successor model (tests/support_serving.py: its greedy output spells "\\nHé€😀!"
over and over, one token per byte) under the served name "tiny-chat"; `bare` serves a checkpoint
without a tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support_serving import CHAIN, expected_text, make_successor_checkpoint
from support_worker import WorkerProcess, start_worker, write_token

from daemon.tinymodel import make_tiny_checkpoint

NAME = "tiny-chat"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("openai")
    make_successor_checkpoint(r / "succ")
    make_tiny_checkpoint(r / "bare", seed=4)
    write_token(r)
    return r


@pytest.fixture(scope="module")
def w(root: Path) -> Iterator[WorkerProcess]:
    proc = start_worker(root / "succ", root / "token", extra=["--served-model-name", NAME, "--version", "v1"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def bare(root: Path) -> Iterator[WorkerProcess]:
    proc = start_worker(root / "bare", root / "token")
    yield proc
    proc.stop()


def client(w: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{w.url}/v1", api_key="unused", max_retries=0, timeout=60)


def extra(obj: Any, key: str) -> Any:
    return (obj.model_extra or {}).get(key)


def test_models_lists_the_served_name_with_the_weight_version(w: WorkerProcess) -> None:
    c = client(w)
    models = c.models.list().data
    assert [m.id for m in models] == [NAME]
    assert extra(models[0], "metadata")["weight_version"] == "v1"
    assert extra(models[0], "max_model_len") == 512
    assert c.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as exc:
        c.models.retrieve("gpt-4")
    assert exc.value.code == "model_not_found"


def test_completion_spells_the_chain_and_names_the_served_model(w: WorkerProcess) -> None:
    c = client(w)
    r = c.completions.create(model=NAME, prompt="H", max_tokens=11, temperature=0)
    want = expected_text(CHAIN, "H", 11).decode()  # "é€😀!\n": 11 byte tokens, 5 characters
    assert r.choices[0].text == want
    assert r.model == NAME and extra(r, "weight_version") == "v1"
    assert r.usage.completion_tokens == 11 and r.choices[0].finish_reason == "length"
    # `model` may be left out (many tools do); a wrong one is a 404 naming the right one
    assert client(w).completions.create(model="", prompt="H", max_tokens=2, temperature=0,
                                        extra_body={"model": None}).model == NAME


@pytest.mark.parametrize("n_tokens", [4, 9, 14, 23])
def test_streamed_completion_text_equals_the_whole_text(w: WorkerProcess, n_tokens: int) -> None:
    c = client(w)
    whole = c.completions.create(model=NAME, prompt="H", max_tokens=n_tokens, temperature=0).choices[0].text
    chunks = list(c.completions.create(model=NAME, prompt="H", max_tokens=n_tokens, temperature=0, stream=True))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == whole
    assert whole == expected_text(CHAIN, "H", n_tokens).decode("utf-8", errors="replace")
    # no delta carries half a character: only a max_tokens cut mid-character leaves U+FFFD, at the end
    assert all("\ufffd" not in t for t in texts[:-1])
    assert any(ord(ch) > 0xFFFF for ch in whole) or n_tokens < 9
    assert {extra(ch, "weight_version") for ch in chunks} == {"v1"}


def test_chat_completion_and_its_stream_agree(w: WorkerProcess) -> None:
    c = client(w)
    messages = [{"role": "system", "content": "Réponds brièvement."}, {"role": "user", "content": "Grüß dich 👋"}]
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=13, temperature=0)
    text = r.choices[0].message.content
    assert text == expected_text(CHAIN, "\n", 13).decode()  # the template ends "assistant\n"
    assert r.choices[0].message.role == "assistant" and r.model == NAME and r.object == "chat.completion"
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=13, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 13
    assert r.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 10


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_sends_usage_exactly_once_on_a_last_chunk_without_choices(w: WorkerProcess, chat: bool) -> None:
    # OpenAI's protocol: with include_usage every chunk carries `usage: null` except one extra last chunk,
    # whose `choices` is empty; without it no chunk carries usage (the finish chunk included).
    c = client(w)

    def stream(**kw: Any) -> list[Any]:
        if chat:
            return list(c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=7, temperature=0, stream=True, **kw))
        return list(c.completions.create(model=NAME, prompt="H", max_tokens=7, temperature=0, stream=True, **kw))

    chunks = stream(stream_options={"include_usage": True})
    with_usage = [i for i, ch in enumerate(chunks) if ch.usage is not None]
    assert with_usage == [len(chunks) - 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 7
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].usage is None
    assert all("usage" in (ch.model_fields_set | set(ch.model_extra or {})) for ch in chunks)  # null, not absent
    plain = stream()
    assert all(ch.usage is None for ch in plain) and all(ch.choices for ch in plain)


def test_penalties_change_the_output_and_are_range_checked(w: WorkerProcess) -> None:
    c = client(w)
    plain = c.completions.create(model=NAME, prompt="H", max_tokens=60, temperature=0).choices[0].text
    rep = c.completions.create(model=NAME, prompt="H", max_tokens=60, temperature=0,
                               frequency_penalty=2.0).choices[0].text
    pres = c.completions.create(model=NAME, prompt="H", max_tokens=60, temperature=0,
                                presence_penalty=2.0).choices[0].text
    # the chain repeats every 12 tokens with a logit margin of 8: counted repeats must break it
    assert rep != plain and pres == plain  # presence costs 2 once, less than the margin
    assert rep[:20] == plain[:20]  # nothing changes before tokens repeat
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=NAME, prompt="H", max_tokens=2, presence_penalty=3.0)
    assert exc.value.param == "presence_penalty"


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [
        ({"seed": 2**64}, "seed", "invalid_value"),
        ({"extra_body": {"temperature": "hot"}}, "temperature", "invalid_value"),
        ({"max_tokens": 10_000}, "max_tokens", "context_length_exceeded"),
        ({"n": 2}, "n", "unsupported_parameter"),
        ({"stop": ["x"]}, "stop", "unsupported_parameter"),
        ({"logprobs": 2}, "logprobs", "unsupported_parameter"),
        ({"extra_body": {"prompt": [1, 999]}}, "prompt", "invalid_value"),
        ({"extra_body": {"stream": "yes"}}, "stream", "invalid_value"),
    ],
)
def test_bad_requests_are_error_objects_naming_the_field(w: WorkerProcess, kwargs: dict, param: str, code: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(w).completions.create(model=NAME, prompt="H", **{"max_tokens": 2, **kwargs})
    err = exc.value
    assert err.status_code == 400 and err.param == param and err.code == code, err.body
    assert err.type == "invalid_request_error" and param in err.message


def test_unknown_model_route_and_method_are_error_objects(w: WorkerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client(w).completions.create(model="gpt-3.5-turbo-instruct", prompt="H", max_tokens=2)
    assert exc.value.code == "model_not_found" and NAME in exc.value.message
    for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/completions"), ("POST", "/v1/models")):
        r = httpx.request(method, f"{w.url}{path}", timeout=10)
        assert r.status_code in (404, 405), (path, r.status_code)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_chat_without_a_chat_template_is_a_clear_400(bare: WorkerProcess) -> None:
    c = client(bare)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert exc.value.code == "chat_template_missing" and "no tokenizer" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model="llama", prompt="hello", max_tokens=2)
    assert exc.value.code == "no_tokenizer" and "token ids" in exc.value.message
    ids = c.completions.create(model="llama", prompt=[1, 5, 9], max_tokens=3, temperature=0)
    assert len(extra(ids.choices[0], "token_ids")) == 3 and ids.choices[0].text == ""


def test_bad_chat_messages_name_the_problem(w: WorkerProcess) -> None:
    c = client(w)
    for messages, needle in (([], "non-empty"), ([{"role": "wizard", "content": "x"}], "role"),
                             ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                              "only text parts")):
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
        assert needle in exc.value.message and exc.value.param == "messages"
    parts = c.chat.completions.create(model=NAME, max_tokens=3, temperature=0,
                                      messages=[{"role": "user", "content": [{"type": "text", "text": "hé"}]}])
    assert parts.choices[0].message.content == expected_text(CHAIN, "\n", 3).decode()
