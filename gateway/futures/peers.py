"""What the other gateways on this database finished, heard at once: a client waiting on one
gateway for a result another one writes (behind a balancer, or several gateways on one host) is
answered when the result is written, not at the next look at the rows.

- PostgreSQL: the finishing transaction sends a NOTIFY on CHANNEL, delivered on commit to one
  listening connection per gateway (a thread of its own: psycopg waits for notices blocking).
- SQLite (its gateways share a host: one database file): after the commit, a datagram to each
  other gateway's Unix socket, the files of `<database>.gateways/`. A socket nobody reads any
  more (its gateway was killed) is removed by the first sender it refuses.

A message is [writer, request_id, sampling_session_id, clone, running]: the last three are a
sample's (null but for one), `running` the samples of its sampling session still running on the
writer (a poll woken by it gathers only while more are coming). It only wakes: a message lost (a listener reconnecting, a full socket queue) leaves the
waiter to its net, a look at the rows every NET_S.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import threading
import time
from typing import Callable

from sqlalchemy import text

log = logging.getLogger(__name__)

Target = tuple[str, int]        # (sampling_session_id, cloned_sampler_id)
# (request_id, its sample's target, the target's samples still running on the writer), on the event loop
Heard = Callable[[str, "Target | None", int], None]

CHANNEL = "tinkerd_finished"
NET_S = 0.5                     # how often a waiter looks at the rows while messages are heard
_NOTIFY = text("SELECT pg_notify(:channel, :payload)")
_LISTEN_RETRY_S = 1.0
_PEERS_FRESH_S = 1.0            # how long a listing of the other gateways' sockets is used


class Peers:
    """This gateway's side of the channel: announces its finishes, hears the others'."""

    def __init__(self, engine, instance: str):
        self.engine, self.instance = engine, instance
        self.listening = False          # the others' messages reach this gateway now
        self.postgres = engine.dialect.name == "postgresql"
        database = engine.url.database if engine.dialect.name == "sqlite" else None
        self._dir = None
        if database and database != ":memory:" and engine.url.query.get("mode") != "memory":
            self._dir = os.path.abspath(database) + ".gateways"
        self._dir_fd: int | None = None
        self._name = hashlib.sha256(instance.encode()).hexdigest()[:16] + ".sock"
        self._sender: socket.socket | None = None
        self._others: list[str] = []
        self._others_at = -_PEERS_FRESH_S

    def _message(self, request_id: str, target: Target | None, running: int) -> str:
        return json.dumps([self.instance, request_id, *(target or (None, None)), running])

    def in_transaction(self, conn, request_id: str, target: Target | None, running: int = 0) -> None:
        """In the transaction finishing `request_id`: PostgreSQL's notice, sent on its commit."""
        if self.postgres:
            conn.execute(_NOTIFY, {"channel": CHANNEL, "payload": self._message(request_id, target, running)})

    def committed(self, request_id: str, target: Target | None, running: int = 0) -> None:
        """After the transaction finishing `request_id` committed: SQLite's datagrams."""
        if self._sender is None:
            return
        others = self._listing()
        if not others:
            return
        data = self._message(request_id, target, running).encode()
        for name in others:
            try:
                self._sender.sendto(data, self._path(name))
            except (ConnectionRefusedError, FileNotFoundError):     # its gateway is gone
                self._forget(name)
            except OSError:         # its queue is full: the waiter's net covers it
                pass

    def _path(self, name: str) -> str:
        # Through the directory's descriptor: a socket's path is limited to 107 bytes, a state
        # dir's is not.
        return f"/proc/self/fd/{self._dir_fd}/{name}"

    def _listing(self) -> list[str]:
        stamp = time.monotonic()
        if stamp - self._others_at > _PEERS_FRESH_S:
            try:
                self._others = [n for n in os.listdir(self._path("")) if n.endswith(".sock") and n != self._name]
            except OSError:
                self._others = []
            self._others_at = stamp
        return self._others

    def _forget(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except OSError:
            pass
        self._others = [n for n in self._others if n != name]

    def listen(self, heard: Heard) -> Callable[[], None]:
        """Hears the other gateways' finishes from now on (a thread); returns what stops it."""
        loop, stop = asyncio.get_running_loop(), threading.Event()
        if self.postgres:
            target = self._listen_postgres
        elif self._dir is not None:
            os.makedirs(self._dir, mode=0o700, exist_ok=True)
            self._dir_fd = os.open(self._dir, os.O_PATH | os.O_DIRECTORY)
            receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                os.unlink(self._path(self._name))
            except FileNotFoundError:
                pass
            receiver.bind(self._path(self._name))
            receiver.settimeout(1.0)            # to see `stop` while nothing comes
            self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sender.setblocking(False)
            self.listening = True

            def target(heard, loop, stop):
                self._receive(receiver, heard, loop, stop)
        else:
            return lambda: None
        threading.Thread(target=target, args=(heard, loop, stop), name="peer-finishes", daemon=True).start()

        def stopped() -> None:
            stop.set()
            self.listening = False
            if self._sender is not None:
                self._sender, sender = None, self._sender
                sender.close()
                self._forget(self._name)
                os.close(self._dir_fd)
        return stopped

    def _deliver(self, payload: str, heard: Heard, loop: asyncio.AbstractEventLoop) -> None:
        writer, request_id, session, clone, running = json.loads(payload)
        if writer != self.instance:
            loop.call_soon_threadsafe(heard, request_id, None if session is None else (session, clone), running)

    def _receive(self, receiver: socket.socket, heard: Heard, loop, stop: threading.Event) -> None:
        with receiver:
            while not stop.is_set():
                try:
                    data = receiver.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    break
                try:
                    self._deliver(data.decode(), heard, loop)
                except (ValueError, RuntimeError):      # not ours; or the loop closed
                    pass

    def _listen_postgres(self, heard: Heard, loop, stop: threading.Event) -> None:
        while not stop.is_set():
            raw = None
            try:
                raw = self.engine.raw_connection()
                conn = raw.driver_connection
                raw.detach()                  # held for good: not the pool's any more
                conn.rollback()
                conn.autocommit = True
                conn.execute(f"LISTEN {CHANNEL}")
                self.listening = True
                while not stop.is_set():
                    for notice in conn.notifies(timeout=1.0):
                        self._deliver(notice.payload, heard, loop)
            except Exception as e:  # noqa: BLE001 - the nets cover the gap; the listener comes back
                log.warning("finish notices: %s: %s; listening again in %.0f s", type(e).__name__, e,
                            _LISTEN_RETRY_S)
                stop.wait(_LISTEN_RETRY_S)
            finally:
                self.listening = False
                if raw is not None:
                    try:
                        raw.close()
                    except Exception:  # noqa: BLE001 - a connection already broken
                        pass
