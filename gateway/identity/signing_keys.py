"""The gateway's signing keys, kept out of the database: whoever can read the database (a backup,
a read replica, a local user on a loose state dir) must not be able to mint a JWT or a download URL.

A keys file holds one key a line, newest first: `<kid> <secret>` (kid: [A-Za-z0-9_-]{1,32};
secret: 32+ bytes, urlsafe base64), `#` starts a comment. The newest key signs; every key in the
file verifies, so a key is rotated without downtime: add a new first line (`tinkerd keys
rotate-signing-key`), and remove the old one once the tokens and URLs it signed have expired
(JWTs: --token-ttl-s; download URLs: 24 h). Gateways re-read the file when it changes (checked
every RELOAD_S), so every gateway on a shared file or a mounted Kubernetes Secret follows.

By default the file is <state-dir>/signing-keys, made (0600, one random key) by the first gateway
to start; --signing-keys-file names another (a mounted Secret). Each line's secret is never used
as is: JWTs and download URLs get separate keys derived from it (HKDF-Expand, RFC 5869, with a
label per use), so a URL signature can never pass as a JWT signature or the reverse.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time

from tinkerd.errors import UserError

log = logging.getLogger(__name__)
RELOAD_S = 2.0
MIN_SECRET_BYTES = 32
MAX_KEYS = 16
JWT = b"tinkerd jwt v1"
DOWNLOAD_URL = b"tinkerd download url v1"
_LINE = re.compile(r"^([A-Za-z0-9_-]{1,32})\s+([A-Za-z0-9_=-]+)$")


def derive(secret: bytes, label: bytes) -> bytes:
    """HKDF-Expand (RFC 5869) of one 32-byte block: the secret is already uniformly random, so
    the extract step adds nothing."""
    return hmac.new(secret, label + b"\x01", hashlib.sha256).digest()


@dataclasses.dataclass(frozen=True, repr=False)
class SigningKey:
    """One line of the keys file, as the two keys derived from it (repr=False: keep out of logs)."""
    kid: str
    jwt: bytes
    url: bytes


def _parse(text: str, path: str) -> list[SigningKey]:
    found: list[SigningKey] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if m is None:
            raise UserError(f"{path}:{n}: a key line is `<kid> <secret>` (kid: letters, digits, _ or -, at most "
                            f"32; secret: urlsafe base64)")
        try:
            secret = base64.urlsafe_b64decode(m.group(2) + "=" * (-len(m.group(2)) % 4))
        except ValueError:
            raise UserError(f"{path}:{n}: the secret is not urlsafe base64") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise UserError(f"{path}:{n}: the secret has {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed "
                            f"(make one: tinkerd keys rotate-signing-key --signing-keys-file {path})")
        if any(k.kid == m.group(1) for k in found):
            raise UserError(f"{path}:{n}: kid {m.group(1)!r} appears twice")
        found.append(SigningKey(m.group(1), derive(secret, JWT), derive(secret, DOWNLOAD_URL)))
    if not found:
        raise UserError(f"{path} holds no signing key (make one: tinkerd keys rotate-signing-key "
                        f"--signing-keys-file {path})")
    if len(found) > MAX_KEYS:
        raise UserError(f"{path} holds {len(found)} keys, at most {MAX_KEYS}: remove the oldest (last) ones")
    return found


def new_line() -> str:
    return f"{secrets.token_hex(4)} {secrets.token_urlsafe(MIN_SECRET_BYTES)}\n"


def create_if_missing(path: str) -> bool:
    """Makes a keys file with one new key (mode 0600) unless one exists; True if made. Several
    gateways starting at once on one state dir agree: the file appears whole (link of a finished
    temporary file), and only the first link wins."""
    if os.path.exists(path):
        return False
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("# tinkerd signing keys, newest first (gateway/identity/signing_keys.py)\n" + new_line())
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def rotate(path: str, keep: int = 2) -> str:
    """Puts a new key first (it signs from the next reload on) and keeps the `keep` newest keys in
    all (the previous ones verify what they signed until removed). Returns the new kid."""
    if keep < 1:
        raise UserError("--keep must be at least 1 (the new key)")
    with open(path) as f:
        old = [line for line in f.read().splitlines() if line.split("#", 1)[0].strip()]
    line = new_line()
    body = "# tinkerd signing keys, newest first (gateway/identity/signing_keys.py)\n" + line + "".join(
        f"{x}\n" for x in old[:keep - 1])
    _parse(body, path)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)              # readers see the old file or the new one, never half of one
    return line.split()[0]


class KeyRing:
    """The keys of one file, re-read when it changes (at most every RELOAD_S)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._checked = 0.0
        self._keys: list[SigningKey] = []
        self._reload(force=True)

    def _reload(self, force: bool = False) -> None:
        st = os.stat(self.path)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if not force and stamp == self._stamp:
            return
        with open(self.path) as f:
            keys = _parse(f.read(), self.path)
        self._keys, self._stamp = keys, stamp

    def keys(self) -> list[SigningKey]:
        if time.monotonic() - self._checked >= RELOAD_S:
            with self._lock:
                if time.monotonic() - self._checked >= RELOAD_S:
                    try:
                        self._reload()
                    except (OSError, UserError) as e:     # a bad edit: keep the keys we have, say why
                        log.warning("signing keys not reloaded, keeping the %d loaded: %s", len(self._keys), e)
                    self._checked = time.monotonic()
        return self._keys

    @property
    def current(self) -> SigningKey:
        return self.keys()[0]

    def find(self, kid: str) -> SigningKey | None:
        return next((k for k in self.keys() if k.kid == kid), None)
