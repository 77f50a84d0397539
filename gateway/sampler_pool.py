"""The sampler replicas a gateway sends samples to, as they come and go.

Members: the `--sampler` addresses the gateway was started with, and the replicas that registered
themselves (`tinkerd sampler --register-with URL`; rows in the shared database, so every gateway
sees them) and heart-beat within REGISTRATION_TTL_S. Each member is health-checked every
HEALTH_EVERY_S over the standard grpc.health.v1 service (what kubelet and grpc_health_probe ask
too); a member whose check or call fails is out of rotation until a check passes. This is the one
place replicas are health-checked: the gateway's /healthz reads the live set from here.

Routing: among live members, those that already served or received the snapshot first (its
adapter is loaded there), then the fewest samples in flight from this gateway. A sample whose
replica dies or refuses it mid-request is sent to another one: sampling changes nothing, so the
resend cannot double anything, and the SDK sees one answer. A replica that goes silent (its host
cut off: no error ever comes back) is given up on after LOST_AFTER_CHECKS failed health checks in
a row, and so is a member that leaves the pool: the samples in flight there are re-driven the same
way. With no live member a sample waits, up to `--sampler-wait-s`, for one to come (back).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import itertools
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import select

from gateway.storage.db import Database, SamplerReplicaRow, now
from gateway.traces import spans
from tinkerd.errors import UnavailableError
from tinkerd.rpc import AioCallsWithMetadata, ServiceAuth, aio_channel, deadline_calls
from tinkerd.v1 import sampler_pb2, sampler_pb2_grpc

log = logging.getLogger(__name__)

REGISTRATION_TTL_S = 15.0
HEALTH_EVERY_S = 1.0
LOST_AFTER_CHECKS = 3       # failed health checks in a row after which the samples in flight there are re-driven
# Codes meaning "this replica did not do it": another one may.
_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
_HOLDERS_KEPT = 4096


@dataclasses.dataclass
class Member:
    address: str
    stub: AioCallsWithMetadata          # a SamplerStub whose calls carry the service token
    channel: grpc.aio.Channel
    static: bool
    alive: bool = False
    in_flight: int = 0
    served: int = 0          # samples this replica answered for this gateway (the listing shows it)
    weight_transport: str = ""   # how the trainer's last push reached it (tinkerd/weight_transport.py)
    failed_checks: int = 0       # in a row
    reached: bool = False        # a health check passed since it joined (else its address may be wrong)
    calls: set = dataclasses.field(default_factory=set)      # its Sample calls in flight
    picked: int = 0              # when it was last picked (the pool's pick count)


class SamplerPool:
    """Made inside the running event loop (grpc.aio channels bind to it)."""

    def __init__(self, static: list[str], db: Database, auth: ServiceAuth, *, timeout_s: float, wait_s: float):
        self.db, self.auth, self.timeout_s, self.wait_s = db, auth, timeout_s, wait_s
        self.members: dict[str, Member] = {}
        # snapshot_id -> addresses that hold it (most recent last), for affinity.
        self._holders: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        self._picks = itertools.count(1)
        for address in static:
            self._add(address, static=True)
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._watch())

    def _add(self, address: str, *, static: bool) -> Member:
        # The token goes on each call, not by an interceptor (tinkerd/rpc.py AioCallsWithMetadata);
        # the health check the pool makes on the channel itself is open (tinkerd/rpc.py OPEN_METHODS).
        channel = aio_channel(address, self.auth, deadline_calls("tinkerd.v1.Sampler", self.timeout_s),
                              send_token=False)
        stub = AioCallsWithMetadata(sampler_pb2_grpc.SamplerStub(channel), self.auth.bearer("sampler"))
        member = Member(address, stub, channel, static)
        self.members[address] = member
        log.info("sampler replica %s joined the pool", address)
        return member

    async def _drop(self, address: str) -> None:
        member = self.members.pop(address)
        log.info("sampler replica %s left the pool", address)
        await member.channel.close()

    # ---- membership and health --------------------------------------------------------------

    async def refresh(self) -> None:
        """Members from the registry table, then one health check of each."""
        cutoff = now() - datetime.timedelta(seconds=REGISTRATION_TTL_S)
        # In a thread: a database gone silent must not stop the loop (and /healthz with it).
        registered = set(await asyncio.to_thread(self.db.select, select(SamplerReplicaRow.address).where(
            SamplerReplicaRow.last_seen >= cutoff)))
        for address in registered - set(self.members):
            self._add(address, static=False)
        for address in [a for a, m in self.members.items() if not m.static and a not in registered]:
            await self._drop(address)
        members = list(self.members.values())
        results = await asyncio.gather(*(self._check(m) for m in members))
        for member, alive in zip(members, results):
            if alive != member.alive:
                log.info("sampler replica %s is %s", member.address, "up" if alive else "down")
                member.alive = alive
            member.failed_checks = 0 if alive else member.failed_checks + 1
            member.reached = member.reached or alive
            if member.failed_checks >= LOST_AFTER_CHECKS and member.calls:
                log.warning("sampler replica %s failed %d health checks in a row; re-driving its %d samples in "
                            "flight", member.address, member.failed_checks, len(member.calls))
                for call in list(member.calls):
                    call.cancel()
        if any(m.alive for m in members):
            self._changed.set()

    async def _check(self, member: Member) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(member.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=max(HEALTH_EVERY_S, 2.0))
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def _watch(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a database hiccup must not end the watch
                log.exception("sampler pool refresh failed")
            await asyncio.sleep(HEALTH_EVERY_S)

    async def close(self) -> None:
        self._task.cancel()
        for member in self.members.values():
            await member.channel.close()

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if m.alive]

    def listing(self) -> list[dict]:
        """Every member as this gateway sees it (GET /internal/v1/samplers/list)."""
        return [{"address": m.address, "alive": m.alive, "registered": not m.static, "in_flight": m.in_flight,
                 "served": m.served, "weight_transport": m.weight_transport} for m in self.members.values()]

    def live_addresses(self) -> list[str]:
        """Where a new snapshot is pushed."""
        return [m.address for m in self.live()]

    def holds(self, snapshot_id: str, addresses: list[str], transports: dict[str, str] | None = None) -> None:
        """Records that these replicas have the snapshot loaded (and, from a push's reply, the
        weight transport that reached each)."""
        for address, transport in (transports or {}).items():
            if address in self.members:
                self.members[address].weight_transport = transport
        if not snapshot_id:
            return
        holders = self._holders.pop(snapshot_id, [])
        self._holders[snapshot_id] = [a for a in holders if a not in addresses] + list(addresses)
        while len(self._holders) > _HOLDERS_KEPT:
            self._holders.popitem(last=False)

    # ---- routing ------------------------------------------------------------------------------

    def pick(self, snapshot_id: str, exclude: set[str]) -> Member | None:
        candidates = [m for m in self.live() if m.address not in exclude]
        if not candidates:
            return None
        holders = set(self._holders.get(snapshot_id, ())) if snapshot_id else set()
        # Equally loaded holders take turns: samples that each finish before the next arrives
        # would otherwise all go to the first one.
        chosen = min(candidates, key=lambda m: (m.address not in holders, m.in_flight, m.picked))
        chosen.picked = next(self._picks)
        return chosen

    async def sample(self, msg: sampler_pb2.SampleRequest) -> sampler_pb2.SampleResponse:
        """Samples on a live replica; on a replica failure, again on another one."""
        deadline = time.monotonic() + self.wait_s
        tried: set[str] = set()
        while True:
            member = self.pick(msg.snapshot_id, tried)
            if member is None:
                if time.monotonic() > deadline:
                    raise UnavailableError(f"no sampler replica answered for {self.wait_s:.0f} s; "
                                           f"send the request again later")
                tried.clear()          # a replica that failed may be back: the next check says
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), HEALTH_EVERY_S)
                except asyncio.TimeoutError:
                    pass
                continue
            member.in_flight += 1
            spans.note(service=f"sampler {member.address}", started=True)     # the request's span
            call = member.stub.Sample(msg)
            member.calls.add(call)
            try:
                reply = await call
            except grpc.aio.AioRpcError as e:
                if e.code() not in _FAILOVER_CODES:
                    raise
                log.warning("sampler replica %s failed a sample (%s: %s); sending it to another",
                            member.address, e.code().name, e.details())
                member.alive = False
                tried.add(member.address)
                continue
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise               # this request itself was cancelled, not the replica given up on
                # The pool gave the replica up (refresh) or closed its channel (_drop) with this call in flight.
                log.warning("sampler replica %s failed a sample (lost: given up with it in flight); sending it "
                            "to another", member.address)
                member.alive = False
                tried.add(member.address)
                continue
            finally:
                member.in_flight -= 1
                member.calls.discard(call)
            member.served += 1
            self.holds(msg.snapshot_id, [member.address])
            return reply
