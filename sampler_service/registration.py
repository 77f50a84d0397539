"""A replica joining the gateways' sampler pool by itself: it registers its address with each
gateway given (`--register-with URL`, repeatable) and re-registers every HEARTBEAT_S, which is
also its heartbeat; on a clean stop it deregisters. The gateways keep the pool in their shared
database (gateway/sampler_pool.py), so registering with one of them reaches all.

The address it registers is --advertise-address, else (advertised_address) 127.0.0.1 for a
replica that listens on loopback, else this host's address as its own name resolves here: a
container's or pod's IP (Docker and Kubernetes map the hostname to it), or the hostname itself
where it maps to loopback (many Linux hosts). Give --advertise-address when the gateways and
the trainer reach this host by another name."""

from __future__ import annotations

import json
import ipaddress
import logging
import socket
import threading
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
RETRY_S = 1.0          # after a failed registration (the gateway may still be starting)


def advertised_address(listen: str, port: int, given: str = "") -> str:
    """host:port the gateways and the trainer are told to reach this replica at."""
    if given:
        return given
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return f"127.0.0.1:{port}"
    if host not in ("0.0.0.0", "::", ""):
        return f"{host}:{port}"                      # listens on one interface: that one
    name = socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError:
        return f"{name}:{port}"
    return f"{name if ipaddress.ip_address(ip).is_loopback else ip}:{port}"


class Registration:
    def __init__(self, gateways: list[str], address: str, token: str):
        self.gateways, self.address, self.token = [g.rstrip("/") for g in gateways], address, token
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
        self._thread.join(timeout=HEARTBEAT_S)
        self._post_all("deregister")

    def _beat(self) -> None:
        while not self._stop.is_set():
            reached_all = self._post_all("register")
            self._stop.wait(HEARTBEAT_S if reached_all else RETRY_S)

    def _post_all(self, action: str) -> bool:
        """Whether every gateway answered."""
        reached_all = True
        for gateway in self.gateways:
            request = urllib.request.Request(
                f"{gateway}/internal/v1/samplers/{action}", data=json.dumps({"address": self.address}).encode(),
                headers={"content-type": "application/json",
                         **({"authorization": f"Bearer {self.token}"} if self.token else {})})
            try:
                urllib.request.urlopen(request, timeout=HEARTBEAT_S).close()
            except (urllib.error.URLError, OSError) as e:
                log.warning("could not %s with %s: %s", action, gateway, e)
                reached_all = False
        return reached_all
