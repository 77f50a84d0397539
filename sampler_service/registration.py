"""A replica joining the gateways' sampler pool by itself: it registers its address with each
gateway given (`--register-with URL`, repeatable) and re-registers every HEARTBEAT_S, which is
also its heartbeat; on a clean stop it deregisters. The gateways keep the pool in their shared
database (gateway/sampler_pool.py), so registering with one of them reaches all.

The address it registers is --advertise-address, else (advertised_address) 127.0.0.1 for a
replica that listens on loopback, else this host's address as its own name resolves here: a
container's or pod's IP (Docker and Kubernetes map the hostname to it), or the hostname itself
where it maps to loopback (many Linux hosts). Give --advertise-address when the gateways and
the trainer reach this host by another name.

The URL is the gateway's internal listener (`--internal-port`; gateway/listeners.py). Over https
the gateway's certificate is checked against --register-ca (a CA bundle, or the gateway's own
certificate when self-signed) or the system's trust store; with TLS configured, an http URL to
another host is refused (check_urls): the service token would cross the network in clear.

A gateway that refuses the registration (a 4xx: a service token it does not accept, an address it
cannot reach, a URL that is not its internal listener) is a configuration to fix, not a gateway
still starting: the refusal is logged with the gateway's reason, and after REFUSALS_BEFORE_EXIT in
a row the replica stops (`refused` says why, and `tinkerd sampler` exits non-zero with it)."""

from __future__ import annotations

import json
import logging
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable

from tinkerd.rpc import advertised_host, is_local_address, is_loopback

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
RETRY_S = 1.0          # after a failed registration (the gateway may still be starting)
REFUSALS_BEFORE_EXIT = 3     # refusals in a row from a gateway (a token being rotated may take a moment)


def advertised_address(listen: str, port: int, given: str = "") -> str:
    """host:port the gateways and the trainer are told to reach this replica at."""
    return given or f"{advertised_host(listen)}:{port}"


def check_advertised(address: str, gateways: list[str]) -> None:
    """Refuses to register a loopback address with a gateway on another host: neither it nor the
    trainer could reach this replica there (a replica listening on 127.0.0.1 by default, say)."""
    remote = [url for url in gateways if not is_local_address(urllib.parse.urlsplit(url).hostname or "")]
    if remote and is_loopback(address):
        raise SystemExit(f"tinkerd sampler: this replica would register {address} with {remote[0]}, another "
                         f"host, which cannot reach it there: --listen on an address of this host that the "
                         f"gateways and the trainer reach (or 0.0.0.0 and --advertise-address HOST:PORT)")


def check_urls(gateways: list[str], tls: bool) -> None:
    """Refuses a --register-with that is not an http(s) URL, and, when this replica is configured for
    TLS (gRPC certificates or --register-ca), one that would send the token in clear to another host."""
    for url in gateways:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SystemExit(f"tinkerd sampler: --register-with {url!r} is not an http(s) URL of the gateway's "
                             f"internal listener (e.g. https://gateway:8001)")
        if tls and parts.scheme == "http" and not is_loopback(f"{parts.hostname}:0"):
            raise SystemExit(f"tinkerd sampler: --register-with {url} is plain http while TLS is configured: the "
                             f"service token would cross the network in clear; serve the gateway with "
                             f"--https-cert and register at https://")


def client_context(ca_file: str) -> ssl.SSLContext:
    """Verifies the gateway's certificate (and its name) against `ca_file`, else the system's CAs.
    A certificate in the file is trusted as it is (partial chain): the gateway's self-signed one, or
    an intermediate."""
    context = ssl.create_default_context(cafile=ca_file or None)
    if ca_file:
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


class Registration:
    """`on_refused(reason)`: called once, from the registration's thread, when the gateways refused
    it REFUSALS_BEFORE_EXIT times in a row; the heartbeat then ends."""

    def __init__(self, gateways: list[str], address: str, token: str, ca_file: str = "",
                 on_refused: Callable[[str], None] | None = None):
        self.gateways, self.address, self.token = [g.rstrip("/") for g in gateways], address, token
        self.context = client_context(ca_file)
        self.on_refused = on_refused
        self.refused = ""          # why the gateways would not have this replica, once they stopped it
        self._refusals, self._reason = 0, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="registration", daemon=True)

    def start(self) -> "Registration":
        if self.gateways:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Leaves the pool at once (without this, the gateways drop the replica after its
        heartbeat lapses)."""
        if not self.gateways:
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=HEARTBEAT_S)
        self._post_all("deregister")

    def _beat(self) -> None:
        while not self._stop.is_set():
            reached_all = self._post_all("register")
            if self._refusals >= REFUSALS_BEFORE_EXIT:
                self.refused = self._reason
                log.error("tinkerd sampler: stopping: %s", self.refused)
                if self.on_refused:
                    self.on_refused(self.refused)
                return
            self._stop.wait(HEARTBEAT_S if reached_all else RETRY_S)

    def _post_all(self, action: str) -> bool:
        """Whether every gateway answered; a refusal of a registration is counted (`_refusals`)."""
        reached_all, refused = True, False
        for gateway in self.gateways:
            request = urllib.request.Request(
                f"{gateway}/internal/v1/samplers/{action}", data=json.dumps({"address": self.address}).encode(),
                headers={"content-type": "application/json",
                         **({"authorization": f"Bearer {self.token}"} if self.token else {})})
            try:
                urllib.request.urlopen(request, timeout=HEARTBEAT_S, context=self.context).close()
            except urllib.error.HTTPError as e:
                reached_all = False
                if action == "register" and 400 <= e.code < 500:
                    refused, self._reason = True, _refusal(gateway, self.address, e)
                    log.error("%s", self._reason)
                else:
                    log.warning("could not %s with %s: %s", action, gateway, e)
            except (urllib.error.URLError, OSError) as e:
                log.warning("could not %s with %s: %s", action, gateway, e)
                reached_all = False
        if action == "register":
            self._refusals = self._refusals + 1 if refused else 0
        return reached_all


def _refusal(gateway: str, address: str, e: urllib.error.HTTPError) -> str:
    """The gateway's refusal of this replica, in words: its own reason (the gateway names what it
    expected, never a secret), and what to check on this side."""
    try:
        said = json.loads(e.read() or b"{}").get("error", "") or e.reason
    except ValueError:
        said = e.reason
    hint = {401: "this replica's --service-token-file must hold the gateway's service secret (or a sampler "
                 "credential made from it: python -m tinkerd.service_roles sampler)",
            403: "a service token mismatch, or another role's credential: this replica's --service-token-file "
                 "must hold the gateway's service secret (or a sampler credential made from it)",
            404: "--register-with must be the gateway's internal listener (its --internal-host and "
                 "--internal-port)"}.get(e.code, "")
    return (f"{gateway} refused to register this replica ({address}): HTTP {e.code}: {said}"
            + (f"; {hint}" if hint else ""))
