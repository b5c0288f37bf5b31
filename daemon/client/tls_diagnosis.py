"""Why a TLS connection to a push listener failed, in words a trainer can act on.

With TLS 1.3 a server that refuses the client's certificate (none sent, or one its CA did not
sign) does so after the client's handshake has finished: httpx then sees only "server
disconnected". `tls_diagnosis` opens one connection of its own with the same SSL context, sends a
request and reads, which surfaces the server's alert (certificate required, unknown CA, ...).
"""

from __future__ import annotations

import socket
import ssl

import httpx


def tls_problem(exc: BaseException) -> str | None:
    """The TLS cause of a failed connection, in words, or None when it is not a TLS failure."""
    err: BaseException | None = exc
    while err is not None and not isinstance(err, ssl.SSLError):
        err = err.__cause__ or err.__context__
    text = str(err if err is not None else exc)
    if isinstance(err, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
        return ("the daemon's TLS certificate is not trusted (" + (getattr(err, "verify_message", "") or text)
                + "): pass the CA that signed it (--cacert / verify=)")
    if "CERTIFICATE_REQUIRED" in text or "certificate required" in text:
        return ("the push listener requires a client certificate (mTLS: tls_client_ca_file): "
                "pass --cert and --cert-key (cert=)")
    if "UNKNOWN_CA" in text or "BAD_CERTIFICATE" in text or "CERTIFICATE_UNKNOWN" in text:
        return f"the push listener refused this client certificate ({text}): use one its tls_client_ca_file signed"
    if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text:
        return f"the listener does not speak TLS ({text}): use http:// or enable TLS on the push source"
    if err is not None:
        return f"TLS handshake failed ({text})"
    return None


def tls_diagnosis(url: str, context: ssl.SSLContext, client_cert: bool, timeout_s: float = 5.0) -> str | None:
    """The TLS cause of not reaching `url` (https only), or None when TLS is not what failed.

    A listener that completes the handshake and then closes without answering a request has
    refused the client's certificate (asyncio servers close without sending TLS 1.3's alert)."""
    u = httpx.URL(url)
    if u.scheme != "https" or not u.host:
        return None
    try:
        with socket.create_connection((u.host, u.port or 443), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=u.host) as conn:  # fmt: skip
            conn.settimeout(timeout_s)
            conn.sendall(b"HEAD / HTTP/1.1\r\nHost: " + u.host.encode() + b"\r\nConnection: close\r\n\r\n")
            if conn.recv(1):
                return None  # it answers: not a TLS problem
    except ssl.SSLError as exc:
        return tls_problem(exc)
    except OSError:
        return None
    if client_cert:
        return ("the push listener closed the TLS connection without answering: it does not accept this client "
                "certificate (use one signed by the CA in its tls_client_ca_file)")
    return ("the push listener closed the TLS connection without answering: it requires a client certificate "
            "(mTLS, its tls_client_ca_file is set): pass --cert and --cert-key (cert=)")
