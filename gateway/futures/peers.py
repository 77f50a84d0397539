"""What the other gateways on this database finished, heard at once: a client waiting on one
gateway for a result another one writes (behind a balancer, or several gateways on one host) is
answered when the result is written, not at the next look at the rows.

- PostgreSQL: the finishing transaction sends a NOTIFY on CHANNEL, delivered on commit to one
  listening connection per gateway (a thread of its own: psycopg waits for notices blocking).
- SQLite (its gateways share a host: one database file): after the commit, a datagram to each
  other gateway's Unix socket, the files of `<database>.gateways/`. A sender thread sends what
  finished since its last send in one datagram (a receiver queues 10 datagrams at most:
  net.unix.max_dgram_qlen). A socket nobody reads any more (its gateway was killed) is removed
  by the first sender it refuses. Where the sockets cannot be made, the gateway runs without.

A message names the writer and, per finished future, [request_id, sampling_session_id, clone,
running]: the last three are a sample's (null but for one), `running` the samples of its target
(sampling session, clone) still running on the writer (a poll woken by it gathers only while
more are coming there), or AGAIN for a finished sample's completion written again (a resend of
it: a poll that reported it before must look again). A message only wakes: one lost (a listener
reconnecting, a queue full for long) leaves the waiter to its net, a look at the rows every NET_S.
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
AGAIN = -1                      # `running` of a completion written again (Completions.report_again)
NET_S = 0.5                     # how often a waiter looks at the rows while messages are heard
_NOTIFY = text("SELECT pg_notify(:channel, :payload)")
_LISTEN_RETRY_S = 1.0
_PEERS_FRESH_S = 1.0            # how long a listing of the other gateways' sockets is used
_SEND_WAIT_S = 0.05             # a full receiver queue is waited for this long before a datagram is dropped
_BATCH = 256                    # finishes taken for one send at most
_DATAGRAM = 1 << 16             # bytes a datagram holds at most (a larger send is split)


class Peers:
    """This gateway's side of the channel: announces its finishes, hears the others'."""

    def __init__(self, engine, instance: str):
        self.engine, self.instance = engine, instance
        self.listening = False          # the others' messages reach this gateway now
        self.postgres = engine.dialect.name == "postgresql"
        database = engine.url.database if engine.dialect.name == "sqlite" else None
        self._dir = None
        if database and database != ":memory:" and not database.startswith("file:") \
                and engine.url.query.get("mode") != "memory":
            self._dir = os.path.realpath(database) + ".gateways"
        self._dir_fd: int | None = None
        self._name = hashlib.sha256(instance.encode()).hexdigest()[:16] + ".sock"
        self._outbox: list[list] = []           # finishes not sent yet (SQLite)
        self._ready = threading.Condition()
        self._others: list[str] = []
        self._others_at = -_PEERS_FRESH_S

    def _finish(self, request_id: str, target: Target | None, running: int) -> list:
        return [request_id, *(target or (None, None)), running]

    def in_transaction(self, conn, request_id: str, target: Target | None, running: int = 0) -> None:
        """In the transaction finishing `request_id`: PostgreSQL's notice, sent on its commit."""
        if self.postgres:
            payload = json.dumps([self.instance, [self._finish(request_id, target, running)]])
            conn.execute(_NOTIFY, {"channel": CHANNEL, "payload": payload})

    def committed(self, request_id: str, target: Target | None, running: int = 0) -> None:
        """After the transaction finishing `request_id` committed: SQLite's datagram, by the
        sender thread, if there is another gateway (a gateway alone wakes no thread). Never raises:
        the finish is done whatever becomes of its message."""
        if self._dir_fd is None or not self._other_gateways():
            return
        with self._ready:
            self._outbox.append(self._finish(request_id, target, running))
            self._ready.notify()

    def listen(self, heard: Heard) -> Callable[[], None]:
        """Hears the other gateways' finishes from now on (threads); returns what stops it."""
        loop, stop = asyncio.get_running_loop(), threading.Event()
        if self.postgres:
            threading.Thread(target=self._listen_postgres, args=(heard, loop, stop), name="peer-finishes",
                             daemon=True).start()
            return stop.set
        if self._dir is None:
            return lambda: None
        try:
            receiver = self._bind()
        except (OSError, AttributeError) as e:      # no /proc, no O_PATH, a filesystem without sockets
            log.warning("gateways on this database will not hear each other's finishes at once (%s: %s): "
                        "their waiters look at the rows instead", type(e).__name__, e)
            return lambda: None
        self.listening = True
        threading.Thread(target=self._receive, args=(receiver, heard, loop, stop), name="peer-finishes",
                         daemon=True).start()
        threading.Thread(target=self._send, args=(stop,), name="peer-sends", daemon=True).start()

        def stopped() -> None:
            stop.set()
            with self._ready:
                self._ready.notify()
        return stopped

    def _bind(self) -> socket.socket:
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        dir_fd = os.open(self._dir, os.O_PATH | os.O_DIRECTORY)
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            # Through the directory's descriptor: a socket's path is limited to 107 bytes, a
            # state dir's is not.
            path = f"/proc/self/fd/{dir_fd}/{self._name}"
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            receiver.bind(path)
        except BaseException:
            receiver.close()
            os.close(dir_fd)
            raise
        receiver.settimeout(1.0)            # to see `stop` while nothing comes
        self._dir_fd = dir_fd
        return receiver

    def _send(self, stop: threading.Event) -> None:
        """The sender thread: what finished since its last send, to each other gateway."""
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.settimeout(_SEND_WAIT_S)
        dir_fd = self._dir_fd
        try:
            while True:
                with self._ready:
                    while not self._outbox and not stop.is_set():
                        self._ready.wait()
                    finished, self._outbox = self._outbox[:_BATCH], self._outbox[_BATCH:]
                if stop.is_set():
                    return
                try:
                    for data in self._datagrams(finished):
                        self._send_to_others(sender, dir_fd, data)
                except Exception:  # noqa: BLE001 - the waiters' nets cover a message lost
                    log.exception("could not tell the other gateways of %d finishes", len(finished))
        finally:
            sender.close()
            self.listening = False
            self._dir_fd = None
            try:
                os.unlink(f"/proc/self/fd/{dir_fd}/{self._name}")
            except OSError:
                pass
            os.close(dir_fd)

    def _datagrams(self, finished: list[list]) -> list[bytes]:
        data = json.dumps([self.instance, finished]).encode()
        if len(data) <= _DATAGRAM or len(finished) == 1:
            return [data]
        half = len(finished) // 2
        return self._datagrams(finished[:half]) + self._datagrams(finished[half:])

    def _other_gateways(self) -> list[str]:
        """The other gateways' sockets, listed at most _PEERS_FRESH_S ago."""
        stamp = time.monotonic()
        if stamp - self._others_at > _PEERS_FRESH_S:
            try:
                self._others = [n for n in os.listdir(f"/proc/self/fd/{self._dir_fd}")
                                if n.endswith(".sock") and n != self._name]
            except OSError:         # stopped meanwhile
                self._others = []
            self._others_at = stamp
        return self._others

    def _send_to_others(self, sender: socket.socket, dir_fd: int, data: bytes) -> None:
        for name in self._others:
            path = f"/proc/self/fd/{dir_fd}/{name}"
            try:
                sender.sendto(data, path)
            except (ConnectionRefusedError, FileNotFoundError):     # its gateway is gone
                try:
                    os.unlink(path)
                except OSError:
                    pass
                self._others = [n for n in self._others if n != name]
            except OSError:         # its queue stayed full: the waiters' nets cover it
                pass

    def _deliver(self, payload: str | bytes, heard: Heard, loop: asyncio.AbstractEventLoop) -> bool:
        """Hands a message's finishes to the event loop; False once the loop is closed."""
        try:
            writer, finished = json.loads(payload)
            if writer == self.instance:
                return True
            for request_id, session, clone, running in finished:
                loop.call_soon_threadsafe(heard, request_id, None if session is None else (session, clone), running)
        except RuntimeError:            # the event loop closed: the gateway stops
            return False
        except Exception:  # noqa: BLE001 - not a message of ours
            log.warning("a message that is not a gateway's, on the finishes' channel: %r", payload[:200])
        return True

    def _receive(self, receiver: socket.socket, heard: Heard, loop, stop: threading.Event) -> None:
        with receiver:
            while not stop.is_set():
                try:
                    data = receiver.recv(_DATAGRAM)
                except TimeoutError:
                    continue
                except OSError:
                    log.exception("no more messages from the other gateways")
                    self.listening = False
                    return
                if not self._deliver(data, heard, loop):
                    return

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
                        if not self._deliver(notice.payload, heard, loop):
                            return
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
