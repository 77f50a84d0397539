"""Unauthenticated made-up credentials (gateway/identity/auth.py, keys.py), on fake backends: a
random `tml-` key id reads the database off the event loop, once per id within AUTH_CACHE_S; the
ids with no key are remembered in a bounded set of their own, so a flood of them evicts no real
key and leaves the gateway's memory bounded; a made-up `by=` of a signed URL is read off the loop too."""

from __future__ import annotations

import asyncio
import secrets
import sys

from gateway_fakes import gateway  # noqa: F401 - the fixture

from gateway.identity import keys


def _made_up_key() -> str:
    return f"tml-{secrets.token_hex(8)}-{secrets.token_urlsafe(32)[:43]}"


def test_a_flood_of_made_up_keys_reads_off_the_loop_and_evicts_no_one(gateway, monkeypatch):
    api = gateway.api
    store = api.client.app.state.gateway.authenticator.keys
    monkeypatch.setattr(keys.KeyStore, "UNKNOWN_IDS", 64)
    assert api.post("create_session", {"tags": []}).status_code == 200       # the tester's key is cached
    tester_id = store.key_id_of(api.api_key)
    assert store.cached(tester_id)
    reads_on_loop, reads = [], []
    session = store.db.session

    def spied_session():
        if sys._getframe(1).f_code is not keys.KeyStore._lookup.__code__:
            return session()            # another part's read (the replica registry's refresh, ...)
        reads.append(1)
        try:
            asyncio.get_running_loop()
            reads_on_loop.append(1)
        except RuntimeError:
            pass
        return session()
    monkeypatch.setattr(store.db, "session", spied_session)
    flood = [_made_up_key() for _ in range(200)]
    for key in flood:
        r = api.client.get("/api/v1/sessions", headers={"X-API-Key": key})
        assert r.status_code == 401 and "unknown or revoked API key" in r.json()["error"]
    assert len(reads) == 200 and not reads_on_loop
    assert len(store._unknown) == 64                   # bounded: the oldest ids forgotten
    assert store.cached(tester_id)                     # the real key was not evicted
    again = flood[-1]                                  # a repeated made-up id: no second read
    assert api.client.get("/api/v1/sessions", headers={"X-API-Key": again}).status_code == 401
    assert len(reads) == 200
    # A signed URL naming a made-up signer: 404, its lookup off the loop.
    url = f"/files/r:train:0/weights/x/archive.tar?expires=9999999999&by={secrets.token_hex(8)}&kid=k&signature=s"
    assert api.client.get(url, headers={"X-API-Key": ""}).status_code == 404
    assert not reads_on_loop and len(reads) > 200
