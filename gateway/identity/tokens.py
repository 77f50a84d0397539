"""Signed things the gateway hands out: the short-lived JWT the SDK exchanges its API key for
(`POST /api/v1/auth/token`; `RestClient.whoami` reads its claims), and download URLs for
checkpoint files (the SDK's CLI fetches them without credentials).

Both are HMAC-SHA256 under keys derived from the signing keys file (gateway/identity/signing_keys.py), not
from anything in the database, with a different derived key for each use. The JWT's header names
the signing key (`kid`), so after a rotation the tokens signed by the previous key still verify.
Comparisons are of bytes: a credential may hold any character (a non-ASCII one is refused, not a 500).
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import hmac
import json
import threading
import time

from gateway.identity.caller import Caller
from gateway.identity.signing_keys import KeyRing, SigningKey

ISSUER = "tinkerd"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _same(expected: str, given: str) -> bool:
    """Constant-time equality of two strings as bytes (compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogatepass"))


def _json_part(text: str):
    try:
        return json.loads(_unb64(text))
    except ValueError:          # bad base64 (binascii.Error), non-ASCII, bad UTF-8 or JSON
        return None


@dataclasses.dataclass(frozen=True)
class DownloadGrant:
    """What a download URL vouches for; the files route rebuilds it from the checkpoint's row as it
    is now, so the URL stops working once any of it changes: the row (deleted, re-saved: its
    `generation`), its owner, or the reason the signer could read it (`access`: "owner", or
    "public" for another user's published checkpoint). `signer_key_id` is the API key the URL was
    made with, re-checked at download: revoking it ends its URLs."""
    path: str
    expires: int
    signer_key_id: str
    generation: str
    owner: str
    access: str

    def message(self) -> bytes:
        return "\n".join(("tinkerd download v2", self.path, str(self.expires), self.signer_key_id, self.generation,
                          self.owner, self.access)).encode("utf-8", "surrogatepass")


_VERIFIED_KEPT = 4096       # tokens whose signature was checked, kept with their claims


class Signer:
    def __init__(self, keys: KeyRing, token_ttl_s: float):
        self.keys = keys
        self.token_ttl_s = token_ttl_s
        # A token checked once is not checked again (an SDK sends the same one with every request):
        # its claims, and the key that signed it, which must still be in the ring.
        self._verified: collections.OrderedDict[str, tuple[dict, SigningKey]] = collections.OrderedDict()
        self._verified_lock = threading.Lock()       # tokens are checked on the loop and in threads

    @staticmethod
    def _mac(key: bytes, message: bytes) -> str:
        return _b64(hmac.new(key, message, hashlib.sha256).digest())

    def token(self, caller: Caller, *, expires: int | None = None) -> str:
        """A JWT naming the caller; its claim `kid` ties it to the API key, so revoking the key ends
        it. `expires` caps its expiry (a token exchanged for a token keeps the first one's)."""
        key = self.keys.current
        issued = int(time.time())
        exp = issued + int(self.token_ttl_s)
        claims = {"iss": ISSUER, "sub": caller.urn, "org_id": caller.org_id, "email": caller.email,
                  "kid": caller.key_id, "iat": issued, "exp": exp if expires is None else min(exp, expires)}
        header = {"alg": "HS256", "typ": "JWT", "kid": key.kid}
        signed = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        return f"{signed}.{self._mac(key.jwt, signed.encode())}"

    def token_claims(self, token: str) -> dict | None:
        """The claims of a valid, unexpired token of ours; None otherwise."""
        verified = self._verified.get(token)
        if verified is not None:
            claims, key = verified
            if claims["exp"] > time.time() and self.keys.find(key.kid) == key:
                return claims
        claims, key = self._check(token)          # new, expired, or its key changed or left the ring
        with self._verified_lock:
            self._verified.pop(token, None)
            if claims is not None:
                self._verified[token] = (claims, key)
                while len(self._verified) > _VERIFIED_KEPT:
                    self._verified.popitem(last=False)
        return claims

    def _check(self, token: str) -> tuple[dict | None, SigningKey | None]:
        parts = token.split(".")
        if len(parts) != 3:
            return None, None
        header = _json_part(parts[0])
        key = self.keys.find(header.get("kid")) if isinstance(header, dict) and isinstance(
            header.get("kid"), str) else None
        if key is None or header.get("alg") != "HS256":
            return None, None
        if not _same(self._mac(key.jwt, f"{parts[0]}.{parts[1]}".encode("utf-8", "surrogatepass")), parts[2]):
            return None, None
        claims = _json_part(parts[1])
        if not isinstance(claims, dict) or claims.get("iss") != ISSUER:
            return None, None
        if not isinstance(claims.get("exp"), int) or claims["exp"] <= time.time():
            return None, None
        return claims, key

    def token_key_id(self, token: str) -> str | None:
        """The API key id a valid, unexpired token of ours names; None otherwise."""
        claims = self.token_claims(token)
        return claims.get("kid") if claims and isinstance(claims.get("kid"), str) else None

    def url_query(self, grant: DownloadGrant) -> str:
        """The query string of a download URL for `grant` (routes/checkpoints.py)."""
        key = self.keys.current
        return (f"expires={grant.expires}&by={grant.signer_key_id}&kid={key.kid}"
                f"&signature={self._mac(key.url, grant.message())}")

    def url_valid(self, grant: DownloadGrant, kid: str, signature: str) -> bool:
        key: SigningKey | None = self.keys.find(kid)
        return key is not None and grant.expires > time.time() and _same(self._mac(key.url, grant.message()),
                                                                          signature)
