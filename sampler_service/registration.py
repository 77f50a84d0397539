"""A replica joining the gateways' sampler pool by itself: it registers its address with each
gateway given (`--register-with URL`, repeatable) and re-registers every HEARTBEAT_S, which is
also its heartbeat; on a clean stop it deregisters. The gateways keep the pool in their shared
database (gateway/sampler_pool.py), so registering with one of them reaches all."""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0


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
            self._post_all("register")
            self._stop.wait(HEARTBEAT_S)

    def _post_all(self, action: str) -> None:
        for gateway in self.gateways:
            request = urllib.request.Request(
                f"{gateway}/internal/v1/samplers/{action}", data=json.dumps({"address": self.address}).encode(),
                headers={"content-type": "application/json",
                         **({"authorization": f"Bearer {self.token}"} if self.token else {})})
            try:
                urllib.request.urlopen(request, timeout=HEARTBEAT_S).close()
            except (urllib.error.URLError, OSError) as e:
                log.warning("could not %s with %s: %s", action, gateway, e)
