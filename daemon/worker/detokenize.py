"""Incremental detokenization: text deltas that never split a character, in O(1) per token.

Decoding token by token goes wrong two ways: a character spread over several tokens (byte-level
BPE, SentencePiece byte fallback) decodes to U+FFFD until its last byte arrives, and tokenizers
that strip or join spaces give a different text for a token alone than in context. So, as vLLM
and TGI do, each step decodes a short window: the tokens already emitted since the last
boundary (`prefix`) and those after it; the delta is what the window decodes to beyond the
prefix, and it is held back while it ends in U+FFFD (an unfinished character). The window
restarts at each emitted boundary, so its length stays bounded and the whole stream is O(n).

The non-streaming response uses the same object over the same tokens, so its text equals the
concatenated stream by construction, for any tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context: the first generated token then decodes with its leading
# space (SentencePiece drops it at the start of a text) as it would in the middle.
PROMPT_CONTEXT = 5
# A character is at most 4 bytes (4 byte tokens, plus any skipped special tokens): a window
# still ending in U+FFFD after this many pending tokens holds bytes invalid for good; emit them.
MAX_PENDING = 16


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt: list[int], *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt[-PROMPT_CONTEXT:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens before this are emitted
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def add(self, token: int) -> str:
        """Append one generated token; the text it completes ("" while a character is unfinished)."""
        self._ids.append(token)
        window = self._decode(self._ids[self._prefix :])
        if not window.endswith(REPLACEMENT):
            return self._emit(window, len(self._ids))
        if len(self._ids) - self._read < MAX_PENDING:
            return ""  # an unfinished character: wait for its next byte
        # Invalid for good somewhere: emit up to the last cut that ends on a whole character, so
        # a character that has only begun in the last few tokens is still not split.
        for cut in range(len(self._ids) - 1, max(self._read, len(self._ids) - 9), -1):
            part = self._decode(self._ids[self._prefix : cut])
            if not part.endswith(REPLACEMENT):
                return self._emit(part, cut)
        return self._emit(window, len(self._ids))

    def extend(self, tokens: Iterable[int]) -> str:
        return "".join(self.add(t) for t in tokens)

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (an unfinished character)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids[self._prefix :]), len(self._ids))

    def _emit(self, window: str, upto: int) -> str:
        # the window beyond what was emitted already (a tokenizer that rewrote the context
        # gives a shorter window: nothing new then)
        delta = window[len(self._prefix_text) :]
        self._prefix, self._read = self._read, upto
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        if self._prefix > 4 * MAX_PENDING:  # drop what no later decode looks at
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta


def detokenize(tokenizer: Any, prompt: list[int], generated: list[int]) -> str:
    """The whole text of `generated`, exactly as the stream of the same tokens."""
    d = IncrementalDetokenizer(tokenizer, prompt)
    d.extend(generated)
    d.flush()
    return d.text
