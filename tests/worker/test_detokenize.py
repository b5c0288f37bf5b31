"""Incremental detokenization (daemon/worker/detokenize.py), in process, over three kinds of tokenizer
made here with `tokenizers`: byte-level (the seed's), SentencePiece-style byte fallback with `▁`
spaces, and WordPiece. Properties: the deltas concatenate to what decoding the whole sequence
gives, no delta ends inside a character, and the work per token is bounded (counted in decoded
tokens, not timed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.tinymodel import write_tiny_tokenizer
from daemon.worker.detokenize import IncrementalDetokenizer, detokenize

pytestmark = pytest.mark.quick

TEXT = st.text(alphabet=st.sampled_from(list("ab yz,.!?'\nàéü€😀中文ж—")), min_size=1, max_size=40)


def _fast(tok: Any, **special: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def byte_fallback_tokenizer() -> Any:
    """SentencePiece/Llama-2 style: `▁` for spaces, <0xNN> tokens for bytes not in the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("▁", "a", "b", "y", "z", "▁a", "▁b", "ab", ",", ".", "!", "é", "▁é", "中"):
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁", "é")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return _fast(tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def wordpiece_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2}
    for piece in ("a", "b", "y", "z", ",", ".", "!", "?", "'", "##a", "##b", "##y", "##z", "ab", "##ab", "é", "中",
                  "文", "##é"):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return _fast(tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoTokenizer

    d: Path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    return {"bytes": AutoTokenizer.from_pretrained(str(d), local_files_only=True),
            "byte_fallback": byte_fallback_tokenizer(), "wordpiece": wordpiece_tokenizer()}


def _stream(tok: Any, prompt: list[int], ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.add(t) for t in ids]
    deltas.append(d.flush())
    return deltas


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=TEXT, completion=TEXT)
def test_byte_level_stream_equals_the_decoded_text(tokenizers: dict[str, Any], prompt: str, completion: str) -> None:
    tok = tokenizers["bytes"]
    p = tok(prompt)["input_ids"]
    g = tok(completion, add_special_tokens=False)["input_ids"]
    deltas = _stream(tok, p, g)
    assert "".join(deltas) == completion == detokenize(tok, p, g)
    assert all("\ufffd" not in d for d in deltas)  # never half a character


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=TEXT, completion=TEXT)
def test_byte_fallback_keeps_leading_spaces_and_whole_characters(
    tokenizers: dict[str, Any], prompt: str, completion: str
) -> None:
    tok = tokenizers["byte_fallback"]
    p = tok(prompt)["input_ids"]
    full = tok(prompt + " " + completion)["input_ids"]
    if full[: len(p)] != p:
        return  # the join re-tokenized the prompt's end: not a continuation
    g = full[len(p):]
    deltas = _stream(tok, p, g)
    whole = tok.decode(full, skip_special_tokens=True)
    head = tok.decode(p, skip_special_tokens=True)
    assert whole.startswith(head)
    assert "".join(deltas) == whole[len(head):] == detokenize(tok, p, g)
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(["ab", "a", "bab", "yz", ",", "!", "zzy", "abab"]), min_size=1, max_size=12))
def test_wordpiece_continuations_join_without_spaces(tokenizers: dict[str, Any], words: list[str]) -> None:
    tok = tokenizers["wordpiece"]
    ids = tok(" ".join(words), add_special_tokens=False)["input_ids"]
    p, g = ids[:1], ids[1:]
    whole, head = tok.decode(ids, skip_special_tokens=True), tok.decode(p, skip_special_tokens=True)
    assert "".join(_stream(tok, p, g)) == whole[len(head):]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 255), max_size=60))
def test_any_token_sequence_streams_what_the_whole_text_says(tokenizers: dict[str, Any], ids: list[int]) -> None:
    """Random ids (invalid UTF-8, special tokens anywhere): stream == whole, and == decode(all)."""
    tok = tokenizers["bytes"]
    deltas = _stream(tok, [1], ids)
    assert "".join(deltas) == detokenize(tok, [1], ids) == tok.decode(ids, skip_special_tokens=True)


class CountingTokenizer:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.decoded = 0

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, **kw)


@pytest.mark.parametrize("kind", ["text", "garbage", "specials"])
def test_work_per_token_is_bounded(tokenizers: dict[str, Any], kind: str) -> None:
    """O(n): the tokens decoded in total grow linearly with the sequence (a prefix re-decode per
    token would be n^2/2 = 50M here)."""
    import random

    tok = tokenizers["bytes"]
    rnd = random.Random(1)
    if kind == "text":
        ids = tok("".join(rnd.choice("aé€😀中 ") for _ in range(4000)), add_special_tokens=False)["input_ids"]
    elif kind == "garbage":  # lone continuation bytes: every window ends in U+FFFD
        ids = [tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(200))] * 10_000
    else:
        ids = [rnd.choice([3, 4, 7]) for _ in range(10_000)]
    counting = CountingTokenizer(tok)
    text = detokenize(counting, [1], ids)
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert counting.decoded <= 40 * len(ids), counting.decoded
