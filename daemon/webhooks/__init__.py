"""Webhooks: events POSTed as signed JSON to configured URLs, from an outbox table.

    settings   `[[webhooks]]`: url, secret file, event filter, timeout, retry backoff
    events     which registry events are webhook events, and their names ("version.deployed", ...)
    outbox     the session hook that writes a delivery row in the event's own transaction
    signing    the `Hotswap-Signature` header (timestamp + HMAC-SHA256, the Stripe shape) and its check
    sender     one thread per webhook: posts its deliveries in order, retries with backoff
    report     counts per webhook and state, for /status, `hotswap status` and /metrics

A delivery is written with its event (a daemon killed after the event was recorded still sends
it after its restart), keeps one delivery id across every retry (a receiver drops a repeat), and
is sent by a thread of its own webhook: a slow or failing receiver never waits a rollout.
"""
