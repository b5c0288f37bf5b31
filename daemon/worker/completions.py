"""`POST /v1/completions`: OpenAI-style request parsing, non-streaming and SSE responses.

Supported fields: prompt (text, a list of token ids, or a one-element list of either),
max_tokens, temperature, top_p, seed, stream, ignore_eos (as in vLLM), model (ignored).
Anything else that would change the output (n > 1, best_of, stop, logprobs, echo) is refused
with 400 rather than silently ignored. Every response carries `weight_version`; when the
weights changed while a request was in progress (an update from a pause with requests kept)
`weight_versions` lists them in order.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from daemon.worker.control import Controller
from daemon.worker.engine import SamplingParams, Sequence

UNSUPPORTED = ("best_of", "stop", "logprobs", "echo", "suffix", "logit_bias")


class BadCompletion(ValueError):
    pass


def parse_prompt(raw: Any, ctl: Controller) -> list[int]:
    m = ctl.loaded
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]
    if isinstance(raw, str):
        if m.tokenizer is None:
            raise BadCompletion(
                "this model has no tokenizer in its checkpoint: send 'prompt' as a list of token ids"
            )
        ids = list(m.tokenizer(raw, add_special_tokens=True)["input_ids"])
    elif isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        ids = list(raw)
        bad = [t for t in ids if not 0 <= t < m.vocab_size]
        if bad:
            raise BadCompletion(f"token id {bad[0]} is outside the vocabulary (0..{m.vocab_size - 1})")
    else:
        raise BadCompletion("'prompt' must be a string or a list of token ids (one prompt per request)")
    if not ids:
        raise BadCompletion("'prompt' is empty")
    return ids


def parse_sampling(body: dict[str, Any], prompt_len: int, max_positions: int) -> SamplingParams:
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False, 0, [], ""):
            raise BadCompletion(f"'{key}' is not supported by this worker")
    if body.get("n", 1) != 1:
        raise BadCompletion("'n' must be 1")

    def num(key: str, default: float, lo: float, hi: float) -> float:
        v = body.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
            raise BadCompletion(f"'{key}' must be a number in [{lo}, {hi}]")
        return float(v)

    room = max_positions - prompt_len
    if room < 1:
        raise BadCompletion(f"prompt of {prompt_len} tokens leaves no room (context {max_positions})")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = min(16, room)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadCompletion("'max_tokens' must be a positive integer")
    if max_tokens > room:
        raise BadCompletion(f"'max_tokens' {max_tokens} + prompt {prompt_len} exceeds the context {max_positions}")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadCompletion("'seed' must be an integer")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=num("temperature", 1.0, 0.0, 100.0),
        top_p=num("top_p", 1.0, 1e-6, 1.0),
        seed=seed,
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def handle_completion(request: Request, ctl: Controller, model_name: str) -> Response:
    ctl.count()
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "body is not valid JSON")
    refused = ctl.accepting()
    if refused:
        ctl.count(failed=True)
        return _error(503, refused)
    try:
        if not isinstance(body, dict):
            raise BadCompletion("body must be a JSON object")
        if "prompt" not in body:
            raise BadCompletion("'prompt' is required")
        prompt = parse_prompt(body["prompt"], ctl)
        params = parse_sampling(body, len(prompt), ctl.loaded.max_positions)
    except BadCompletion as exc:
        return _error(400, str(exc))

    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, int | None]] = asyncio.Queue()
    seq = Sequence(
        prompt,
        params,
        on_token=lambda _s, t: loop.call_soon_threadsafe(events.put_nowait, ("token", t)),
        on_done=lambda _s: loop.call_soon_threadsafe(events.put_nowait, ("done", None)),
    )
    rid = f"cmpl-{seq.id}-{int(time.time() * 1000)}"
    ctl.engine.submit(seq)
    stream = bool(body.get("stream", False))
    if stream:
        return StreamingResponse(
            _sse(seq, events, ctl, rid, model_name), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        while True:
            kind, _ = await events.get()
            if kind == "done":
                break
    finally:
        if not seq.done:
            seq.cancelled = True  # the client went away
    if seq.finish_reason == "error":
        ctl.count(failed=True)
        return JSONResponse({"error": seq.error or "generation failed", "weight_version": _version(seq, ctl)},
                            status_code=500)
    return JSONResponse(_result(seq, ctl, rid, model_name))


def _version(seq: Sequence, ctl: Controller) -> str:
    return seq.versions[-1] if seq.versions else ctl.store.current.version


def _text(ctl: Controller, ids: list[int]) -> str:
    tok = ctl.loaded.tokenizer
    return tok.decode(ids, skip_special_tokens=True) if tok is not None and ids else ""


def _result(seq: Sequence, ctl: Controller, rid: str, model_name: str) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{
            "index": 0,
            "text": _text(ctl, seq.generated),
            "token_ids": seq.generated,
            "finish_reason": seq.finish_reason,
            "logprobs": None,
        }],
        "usage": {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.generated),
                  "total_tokens": len(seq.prompt) + len(seq.generated)},
        "weight_version": _version(seq, ctl),
    }
    if len(seq.versions) > 1:
        doc["weight_versions"] = seq.versions
    return doc


async def _sse(
    seq: Sequence, events: asyncio.Queue[tuple[str, int | None]], ctl: Controller, rid: str, model_name: str
) -> AsyncIterator[bytes]:
    sent_text = ""
    n = 0  # tokens streamed so far (the list may already be longer: the scheduler runs ahead)
    try:
        while True:
            kind, token = await events.get()
            if kind == "done":
                break
            assert token is not None
            n += 1
            full = _text(ctl, seq.generated[:n])
            delta, sent_text = full[len(sent_text):], full
            chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                     "choices": [{"index": 0, "text": delta, "token_ids": [token], "finish_reason": None,
                                  "logprobs": None}],
                     "weight_version": _version(seq, ctl)}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        final: dict[str, Any] = {
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": seq.finish_reason,
                         "logprobs": None}],
            "usage": {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.generated),
                      "total_tokens": len(seq.prompt) + len(seq.generated)},
            "weight_version": _version(seq, ctl),
        }
        if len(seq.versions) > 1:
            final["weight_versions"] = seq.versions
        if seq.finish_reason == "error":
            ctl.count(failed=True)
            final["error"] = seq.error
        yield f"data: {json.dumps(final)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        if not seq.done:
            seq.cancelled = True
