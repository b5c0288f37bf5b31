"""Secrets out of anything shown: URLs (user:password@, ?password=...&token=...) and documents.

`/status` is unauthenticated and logs are widely read, so what they show passes through here:

    redact_url("postgresql+psycopg://bob:pw@db/x?password=pw&sslmode=require")
        -> "postgresql+psycopg://bob:***@db/x?password=***&sslmode=require"
    redact_doc({"token": "abc", "url": "s3://k:s@h/b", "token_file": "/etc/t"})
        -> {"token": "***", "url": "s3://k:***@h/b", "token_file": "/etc/t"}

A name is secret when it says password/secret/token/credential/signature/key (not a `*_file`,
`*_path` or `*_id`: where a secret lives, or which one, is not the secret; a key file's
contents are never put in a document). URLs are rewritten by hand, so no URL is too
malformed to redact (the fallback of "show it as given" is how secrets leak).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_plus

MASK = "***"
_SECRET = re.compile(
    r"pass(word|wd|phrase)?$|^pwd$|secret|token|credential|signature|^sig$|(^|[_-])(api|access|private|hmac|secret)?[_-]?key$|^auth(orization)?$"
)
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")  # URLs inside a message
_NOT_SECRET = re.compile(r"(_file|_path|_id|_dir|file|path)$")


def is_secret_name(name: str) -> bool:
    n = name.strip().lower()
    return bool(_SECRET.search(n)) and not _NOT_SECRET.search(n)


def redact_url(url: str) -> str:
    """`url` with the password of its user part and every secret query parameter masked.

    Rebuilt by hand rather than by urllib (which turns `sqlite:///x` into `sqlite:/x`): only the
    user part and the query are rewritten, everything else is kept byte for byte."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    # the user part ends at the last "@" before any query (a password may hold an unescaped "/")
    at = rest[: _first(rest, "?#", 0)].rfind("@") if sep else -1
    cut = _first(rest, "/?#", at + 1) if sep else 0
    netloc, tail = rest[:cut], rest[cut:]
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{hostport}" if has_password else netloc
    path, qsep, query = tail.partition("?")
    query, hsep, fragment = query.partition("#")
    if qsep and query:
        query = "&".join(_redact_pair(pair) for pair in query.split("&"))
    return f"{scheme}{sep}{netloc}{path}{qsep}{query}{hsep}{fragment}"


def _first(text: str, chars: str, start: int) -> int:
    return min((i for i in (text.find(c, start) for c in chars) if i >= 0), default=len(text))


def _redact_pair(pair: str) -> str:
    name, eq, _ = pair.partition("=")
    return f"{name}={MASK}" if eq and is_secret_name(unquote_plus(name)) else pair


def redact_doc(doc: Any) -> Any:
    """A copy of a JSON-like document with secret-named values masked and URLs redacted."""
    if isinstance(doc, dict):
        return {k: (_mask(v) if isinstance(k, str) and is_secret_name(k) else redact_doc(v)) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [redact_doc(v) for v in doc]
    if isinstance(doc, str) and "://" in doc:
        return _URL_IN_TEXT.sub(lambda m: redact_url(m.group()), doc)
    return doc


def _mask(value: Any) -> Any:
    return value if value is None or value == "" or isinstance(value, bool) else MASK
