"""Signed things the gateway hands out: the short-lived JWT the SDK exchanges its API key for
(`POST /api/v1/auth/token`; `RestClient.whoami` reads its claims), and download URLs for
external weights (the SDK's CLI fetches them without credentials).

Both are HMAC-SHA256 under one secret kept in the database (made on first start), so every
gateway process on the database verifies what another issued.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time

from sqlalchemy.exc import IntegrityError

from gateway.db import Database, ServerSecretRow
from gateway.keys import Caller

ISSUER = "tinkerd"
_HEADER = {"alg": "HS256", "typ": "JWT"}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def signing_secret(db: Database) -> bytes:
    """The server's signing secret, made by whichever process asks first."""
    row = db.get(ServerSecretRow, "signing")
    if row is None:
        try:
            db.add(ServerSecretRow(name="signing", value=secrets.token_hex(32)))
        except IntegrityError:
            pass
        row = db.get(ServerSecretRow, "signing")
    return bytes.fromhex(row.value)


class Signer:
    def __init__(self, secret: bytes, token_ttl_s: float):
        self.secret = secret
        self.token_ttl_s = token_ttl_s

    def _mac(self, message: str) -> str:
        return _b64(hmac.new(self.secret, message.encode(), hashlib.sha256).digest())

    def token(self, caller: Caller) -> str:
        """A JWT naming the caller; `kid` ties it to the API key, so revoking the key ends it."""
        issued = int(time.time())
        claims = {"iss": ISSUER, "sub": caller.urn, "org_id": caller.org_id, "email": caller.email,
                  "kid": caller.key_id, "iat": issued, "exp": issued + int(self.token_ttl_s)}
        signed = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(claims).encode())}"
        return f"{signed}.{self._mac(signed)}"

    def token_key_id(self, token: str) -> str | None:
        """The API key id a valid, unexpired token of ours names; None otherwise."""
        parts = token.split(".")
        if len(parts) != 3 or not hmac.compare_digest(self._mac(f"{parts[0]}.{parts[1]}"), parts[2]):
            return None
        try:
            claims = json.loads(_unb64(parts[1]))
        except ValueError:
            return None
        if not isinstance(claims, dict) or claims.get("iss") != ISSUER:
            return None
        if not isinstance(claims.get("exp"), int) or claims["exp"] <= time.time():
            return None
        return claims.get("kid") if isinstance(claims.get("kid"), str) else None

    def url_signature(self, path: str, expires: int) -> str:
        return self._mac(f"{path}\n{expires}")

    def url_valid(self, path: str, expires: int, signature: str) -> bool:
        return expires > time.time() and hmac.compare_digest(self.url_signature(path, expires), signature)
