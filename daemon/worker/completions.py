"""The OpenAI-compatible serving routes: /v1/models, /v1/completions, /v1/chat/completions.

One request, top to bottom (`_generate`): read the body (capped) -> validate it (params.py,
400 naming the field) -> refuse if draining/unhealthy (503) or at capacity (429) -> tokenize
or render the chat template off the event loop -> submit a Sequence to the engine -> stream
SSE chunks, or wait for the whole text. A client that disconnects cancels its sequence, queued
or running. Text is detokenized incrementally (detokenize.py), the same way for both forms,
so a streamed text equals the non-streamed one. Every response carries `weight_version`
(and `weight_versions` when an update during a pause changed the weights mid-request), and
`model` is the served model name, the one `/v1/models` lists. A `model` naming a LoRA adapter
(lora.py) runs on the base with that adapter; its response also carries `adapter_version`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from daemon.worker import params as P
from daemon.worker.control import Controller
from daemon.worker.detokenize import IncrementalDetokenizer, detokenize
from daemon.worker.engine import Sequence
from daemon.worker.limits import Admission, Offload, ServingLimits, most_request_bytes, read_json
from daemon.worker.lora import LoadedAdapter
from daemon.worker.metrics import WorkerMetrics
from daemon.worker.model import longest_token_chars
from daemon.worker.openai_errors import ApiError, bad_request, error_body


@dataclass
class Serving:
    """What the serving routes share: the controller, the served name and the limits."""

    ctl: Controller
    name: str
    limits: ServingLimits
    admission: Admission
    offload: Offload
    max_chars: int  # longest text that can fit the context
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)  # GET /metrics (daemon.worker.metrics)

    @classmethod
    def build(cls, ctl: Controller, name: str, limits: ServingLimits) -> Serving:
        m = ctl.loaded
        # a token is at least one character of the longest vocabulary entry's length, so a
        # longer text cannot fit; without a tokenizer only token ids are taken anyway
        per_token = max(1, longest_token_chars(m.tokenizer))
        return cls(ctl, name, limits, Admission(ctl.engine.max_batch + limits.max_queue),
                   Offload(limits.tokenizer_threads), max_chars=m.max_positions * per_token)

    def model_card(self) -> dict[str, Any]:
        cur = self.ctl.store.current
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "hotswap",
                "max_model_len": self.ctl.loaded.max_positions,
                "metadata": {"weight_version": cur.version, "weight_digest": cur.digest,
                             "state": self.ctl.state.value}}  # fmt: skip

    def adapter_cards(self) -> list[dict[str, Any]]:
        """The LoRA adapters served by name, as vLLM lists them (parent: the base, root: its folder)."""
        return [{"id": n, "object": "model", "created": int(a.loaded_at), "owned_by": "hotswap", "parent": self.name,
                 "root": a.path, "metadata": {"adapter_version": a.version, "adapter_digest": a.digest}}
                for n in self.ctl.engine.adapters.names() if (a := self.ctl.engine.adapters.get(n)) is not None]  # fmt: skip

    def adapter_for(self, body: dict[str, Any]) -> LoadedAdapter | None:
        """The adapter version a request's `model` names now (None: the base); 404 for neither."""
        model = body.get("model")
        if isinstance(model, str) and model != self.name and (a := self.ctl.engine.adapters.get(model)) is not None:
            return a
        P.check_model(body, self.name)
        return None

    def count(self, adapter: LoadedAdapter | None, *, failed: bool = False) -> None:
        self.ctl.count(failed=failed)
        if adapter is not None:
            self.ctl.engine.adapters.count(adapter.name, failed=failed)


def install_serving_routes(app: FastAPI, sv: Serving) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [sv.model_card(), *sv.adapter_cards()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        P.check_model({"model": model}, sv.name)
        return JSONResponse(sv.model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, sv, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(request, sv, chat=True)


# -- one request ---------------------------------------------------------------------------------
async def _generate(request: Request, sv: Serving, *, chat: bool) -> Response:
    ctl, m = sv.ctl, sv.ctl.loaded
    body = await read_json(request.body, sv.offload, most_request_bytes(sv.max_chars, m.max_positions))
    adapter = sv.adapter_for(body)  # taken now: the request keeps this version to its last token
    if chat:
        if m.tokenizer is None or not getattr(m.tokenizer, "chat_template", None):
            why = "has no tokenizer" if m.tokenizer is None else "has a tokenizer without a chat template"
            raise bad_request(f"this model {why}, so chat messages cannot be turned into a prompt: "
                              "use /v1/completions", "messages", "chat_template_missing")
        req = P.parse_chat(body, sv.max_chars)
    else:
        req = P.parse_completion(body, sv.max_chars, m.vocab_size, m.max_positions)
        if req.prompt_text is not None and m.tokenizer is None:
            raise bad_request("this model has no tokenizer in its checkpoint: send 'prompt' as a list of "
                              "token ids", "prompt", "no_tokenizer")
    refused = ctl.accepting()
    if refused:
        sv.count(adapter)
        sv.count(adapter, failed=True)
        raise ApiError(503, refused, code="unavailable")
    sv.admission.enter()
    handed_over = False
    try:
        prompt = await sv.offload.run(_tokenize, ctl, req)
        sampling = P.parse_sampling(body, len(prompt), m.max_positions, chat=chat)
        sv.count(adapter)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, int | None]] = asyncio.Queue()

        def on_token(_s: Sequence, token: int) -> None:  # scheduler thread -> this loop
            loop.call_soon_threadsafe(events.put_nowait, ("token", token))

        def on_done(_s: Sequence) -> None:
            sv.metrics.tokens.inc(len(_s.generated))
            loop.call_soon_threadsafe(events.put_nowait, ("done", None))

        # a whole answer needs only the end; a stream every token
        seq = Sequence(prompt, sampling, on_token=on_token if req.stream else None, on_done=on_done, adapter=adapter)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{seq.id}-{int(time.time() * 1000)}"
        ctl.engine.submit(seq)
        if req.stream:
            out = _Output(sv, seq, rid, chat, req.include_usage)

            def closed() -> None:
                _cancel(sv, seq)
                sv.admission.leave()

            handed_over = True
            return SequenceStream(out.sse(events), on_close=closed)
        return await _whole(request, sv, seq, events, rid, chat)
    finally:
        if not handed_over:
            sv.admission.leave()


def _tokenize(ctl: Controller, req: P.Request) -> list[int]:
    """Runs in the offload pool: prompt ids from text, chat messages or ids as given."""
    m = ctl.loaded
    if req.prompt_ids is not None:
        return req.prompt_ids
    tok = m.tokenizer
    assert tok is not None  # text and chat requests are refused earlier without one
    try:
        if req.kind == "chat":
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
            ids = list(tok(text, add_special_tokens=False)["input_ids"])  # the template has the specials
        else:
            ids = list(tok(req.prompt_text, add_special_tokens=True)["input_ids"])
    except Exception as exc:  # noqa: BLE001 - template errors (raise_exception) are the caller's input
        what = "the chat template refused these messages" if req.kind == "chat" else "tokenizing the prompt failed"
        raise bad_request(f"{what}: {str(exc)[:300]}", "messages" if req.kind == "chat" else "prompt") from None
    param = "messages" if req.kind == "chat" else "prompt"
    if not ids:
        raise bad_request("the prompt is empty after tokenization", param)
    if len(ids) >= m.max_positions:
        raise bad_request(f"the prompt is {len(ids)} tokens; this model's context is {m.max_positions} tokens",
                          param, "context_length_exceeded")
    if max(ids) >= m.vocab_size:
        raise bad_request(f"the tokenizer made id {max(ids)}, beyond the model's vocabulary of {m.vocab_size}",
                          param)
    return ids


def _cancel(sv: Serving, seq: Sequence) -> None:
    if not seq.done:
        sv.ctl.engine.cancel(seq)


async def _until_disconnect(receive: Callable[[], Any]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _whole(request: Request, sv: Serving, seq: Sequence, events: asyncio.Queue[tuple[str, int | None]],
                 rid: str, chat: bool) -> Response:
    async def finished() -> None:
        while (await events.get())[0] != "done":
            pass

    done = asyncio.ensure_future(finished())
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (done, gone):
            task.cancel()
        if not done.done() or not seq.done:
            _cancel(sv, seq)  # the client went away: free the slot now, not after max_tokens
    if not seq.done or seq.finish_reason == "cancelled":
        return Response(status_code=499)  # nobody is listening
    out = _Output(sv, seq, rid, chat, False)
    if seq.finish_reason == "error":
        sv.count(seq.adapter, failed=True)
        raise ApiError(500, seq.error or "generation failed", code="generation_failed",
                       extra={"weight_version": out.version()})
    text = await sv.offload.run(detokenize, sv.ctl.loaded.tokenizer, seq.prompt, seq.generated) \
        if sv.ctl.loaded.tokenizer is not None else ""
    return JSONResponse(out.whole(text))


class SequenceStream(StreamingResponse):
    """An SSE response that always runs `on_close` (cancel the sequence, free the slot), also
    when the client is gone before the first chunk."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# -- response documents --------------------------------------------------------------------------
@dataclass
class _Output:
    sv: Serving
    seq: Sequence
    rid: str
    chat: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def version(self) -> str:
        return self.seq.versions[-1] if self.seq.versions else self.sv.ctl.store.current.version

    def _head(self) -> dict[str, Any]:
        model = self.seq.adapter.name if self.seq.adapter is not None else self.sv.name
        return {"id": self.rid, "object": self._object(), "created": self.created, "model": model}

    def _object(self, chunk: bool = False) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def _usage(self) -> dict[str, int]:
        p, g = len(self.seq.prompt), len(self.seq.generated)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    def _tail(self, doc: dict[str, Any]) -> dict[str, Any]:
        doc["weight_version"] = self.version()
        if self.seq.adapter is not None:
            doc["adapter_version"] = self.seq.adapter.version
        if len(self.seq.versions) > 1:
            doc["weight_versions"] = list(self.seq.versions)
        return doc

    def _finish(self) -> str | None:
        return {"cancelled": "abort"}.get(self.seq.finish_reason or "", self.seq.finish_reason)

    def whole(self, text: str) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": self._finish(), "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "token_ids": list(self.seq.generated),
                      "finish_reason": self._finish(), "logprobs": None}
        return self._tail(self._head() | {"choices": [choice], "usage": self._usage()})

    def _chunk(self, text: str | None, token_ids: list[int], finish: str | None, role: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "token_ids": token_ids, "finish_reason": finish,
                      "logprobs": None}
        doc = self._head() | {"object": self._object(chunk=True), "choices": [choice]}
        if self.include_usage:  # OpenAI: null on every chunk but the last, which has no choices
            doc["usage"] = None
        return _sse(self._tail(doc))

    async def sse(self, events: asyncio.Queue[tuple[str, int | None]]) -> AsyncIterator[bytes]:
        tok = self.sv.ctl.loaded.tokenizer
        det = IncrementalDetokenizer(tok, self.seq.prompt) if tok is not None else None
        if self.chat:
            yield self._chunk(None, [], None, role=True)
        while True:
            kind, token = await events.get()
            if kind == "done":
                break
            assert token is not None
            text = det.add(token) if det is not None else ""
            if text or not self.chat:  # completions: one chunk per token (its id); chat: per text
                yield self._chunk(text, [token], None)
        rest = det.flush() if det is not None else ""  # an unfinished character at the end
        if self.seq.finish_reason == "error":
            self.sv.count(self.seq.adapter, failed=True)
            err = error_body(500, self.seq.error or "generation failed", code="generation_failed")
            yield _sse(self._tail(err))
        else:
            yield self._chunk(rest, [], self._finish())  # one chunk per token, then this one
            if self.include_usage:
                yield _sse(self._tail(self._head() | {"object": self._object(chunk=True), "choices": [],
                                                      "usage": self._usage()}))
        yield b"data: [DONE]\n\n"


def _sse(doc: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n".encode()
