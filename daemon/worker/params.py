"""Validate an OpenAI completion or chat request into what the engine runs; every refusal is a 400
naming the field.

Supported: prompt (text, token ids, or a one-element list of either) / messages (text content,
as a string or text parts), max_tokens (chat: max_completion_tokens too), temperature, top_p,
seed, presence_penalty, frequency_penalty, stream, stream_options.include_usage, ignore_eos (as
in vLLM), model (must be the served name), user (ignored). Anything else that would change the
output (n > 1, best_of, stop, logprobs, echo, suffix, logit_bias, tools, a JSON response_format)
is refused rather than silently ignored.

Text length is checked before anything is tokenized: a prompt longer than the context times
the longest vocabulary entry cannot fit, whatever the tokenizer makes of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from daemon.worker.engine import SamplingParams
from daemon.worker.limits import finite_number
from daemon.worker.openai_errors import ApiError, bad_request

UNSUPPORTED = ("best_of", "stop", "logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools",
               "tool_choice", "functions", "function_call", "parallel_tool_calls")  # fmt: skip
ROLES = ("system", "developer", "user", "assistant")
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(slots=True)
class Request:
    """A validated request before tokenization."""

    kind: str  # "completion" or "chat"
    prompt_text: str | None  # completion text prompt
    prompt_ids: list[int] | None  # completion token-id prompt
    messages: list[dict[str, str]] | None  # chat
    stream: bool
    include_usage: bool
    body: dict[str, Any]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_model(body: dict[str, Any], served_name: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model != served_name:
        raise ApiError(404, f"the model {model!r} does not exist here; this worker serves {served_name!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False, 0, [], ""):
            raise bad_request(f"'{key}' is not supported by this worker", key, "unsupported_parameter")
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request("'n' must be 1 (one choice per request)", "n", "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("'response_format' other than {\"type\": \"text\"} is not supported",
                          "response_format", "unsupported_parameter")


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad_request("'stream_options.include_usage' must be true or false", "stream_options")
    return stream, usage


def parse_completion(body: dict[str, Any], max_chars: int, vocab_size: int, max_positions: int) -> Request:
    _refuse_unsupported(body)
    stream, usage = _stream_flags(body)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt", "missing_parameter")
    raw = body["prompt"]
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(raw, str):
        if not raw:
            raise bad_request("'prompt' is empty", "prompt")
        _check_chars(len(raw), max_chars, "prompt")
        text = raw
    elif isinstance(raw, list) and all(_is_int(t) for t in raw):
        if not raw:
            raise bad_request("'prompt' is empty", "prompt")
        if len(raw) >= max_positions:
            raise _context_error(len(raw), max_positions)
        bad = next((t for t in raw if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"'prompt' has token id {bad}, outside the vocabulary (0..{vocab_size - 1})", "prompt")
        ids = list(raw)
    else:
        raise bad_request("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    return Request("completion", text, ids, None, stream, usage, body)


def parse_chat(body: dict[str, Any], max_chars: int) -> Request:
    _refuse_unsupported(body)
    stream, usage = _stream_flags(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages",
                          "missing_parameter" if raw is None else "invalid_value")
    messages: list[dict[str, str]] = []
    total = 0
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)} (got {str(role)[:40]!r})",
                              "messages")
        content = _text_content(m.get("content"), where)
        total += len(content)
        _check_chars(total, max_chars, "messages")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    return Request("chat", None, None, messages, stream, usage, body)


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"'{where}.content[{j}]': only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported", "messages", "unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"'{where}.content' must be a string or a list of text parts", "messages")


def _check_chars(n: int, max_chars: int, param: str) -> None:
    if n > max_chars:
        raise bad_request(f"'{param}' is {n} characters: more than this model's context can hold "
                          f"(at most {max_chars} characters), refused before tokenizing",
                          param, "context_length_exceeded")


def _context_error(prompt_len: int, max_positions: int) -> ApiError:
    return bad_request(f"the prompt is {prompt_len} tokens; this model's context is {max_positions} tokens "
                       "and generation needs at least one more", "prompt", "context_length_exceeded")


def parse_sampling(body: dict[str, Any], prompt_len: int, max_positions: int, *, chat: bool) -> SamplingParams:
    def num(key: str, default: float, lo: float, hi: float) -> float:
        v = body.get(key, default)
        if v is None:
            v = default
        if not finite_number(v) or not lo <= v <= hi:
            raise bad_request(f"'{key}' must be a number in [{lo}, {hi}]", key)
        return float(v)

    room = max_positions - prompt_len
    if room < 1:
        raise _context_error(prompt_len, max_positions)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)  # OpenAI: chat runs to the context, completions 16
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad_request(f"'{key}' must be a positive integer", key)
    if max_tokens > room:
        raise bad_request(f"'{key}' {max_tokens} + prompt {prompt_len} tokens exceeds the context of "
                          f"{max_positions} tokens", key, "context_length_exceeded")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise bad_request(f"'seed' must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]", "seed")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be true or false", "ignore_eos")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=num("temperature", 1.0, 0.0, 100.0),
        top_p=num("top_p", 1.0, 1e-6, 1.0),
        seed=seed,
        ignore_eos=ignore_eos,
        presence_penalty=num("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=num("frequency_penalty", 0.0, -2.0, 2.0),
    )
