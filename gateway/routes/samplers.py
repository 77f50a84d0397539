"""Sampler replicas joining and leaving the pool (gateway/sampler_pool.py). Not Tinker: called by
`tinkerd sampler --register-with URL`, authenticated with the service token that the gRPC calls
between services use (without one, only from this machine): gateway/identity/auth.py checks it before any
route, or any body, is read.

A replica this gateway has never reached at the address it registered (its health checks have
failed since, LOST_AFTER_CHECKS in a row, and one more made now fails too) is told so at its next
heartbeat, with a 400 naming the address and the flag to fix: it stops (sampler_service/
registration.py) instead of sitting in the pool where no sample and no weight push reaches it."""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import BaseModel, Field, ValidationError

from gateway.protocol import parse_json
from gateway.sampler_pool import LOST_AFTER_CHECKS
from gateway.state import GatewayDep
from gateway.storage.db import SamplerReplicaRow, now
from tinkerd.errors import UserError

router = APIRouter(prefix="/internal/v1/samplers")


class Replica(BaseModel):
    address: str = Field(min_length=3, max_length=256, pattern=r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$")


async def _replica(request: Request) -> Replica:
    """The calling replica, from its body."""
    try:
        return Replica.model_validate(parse_json(await request.body()))
    except ValidationError as e:
        raise UserError(f"a replica is {{\"address\": \"host:port\"}}: {e.errors()[0]['msg']}") from None


@router.post("/register")
async def register(request: Request, gw: GatewayDep) -> dict:
    """Joins the pool, or heart-beats: a replica re-registers every few seconds."""
    replica = await _replica(request)
    if await gw.db.run(_heartbeat, gw.db, replica.address) and \
            (unreachable := await _unreachable(gw, replica.address)) is not None:
        raise UserError(f"this gateway cannot reach the sampler replica at {replica.address}, the address it "
                        f"registered ({unreachable}), and neither, most likely, can the trainer: give `tinkerd "
                        f"sampler` --advertise-address HOST:PORT that the gateways' and the trainer's hosts reach "
                        f"(and --listen on that host's interface)")
    return {"status": "registered"}


def _heartbeat(db, address: str) -> bool:
    """The replica's row seen now, made if new; whether it was there already."""
    if db.touch(SamplerReplicaRow, address, last_seen=now()):
        return True
    db.put(SamplerReplicaRow(address=address))
    return False


# A check of a registered address made for its refusal: as short as the pool's own.
_CHECK_TIMEOUT_S = 2.0


async def _unreachable(gw, address: str) -> str | None:
    """Why this gateway cannot reach `address`, when no health check of it has passed since it
    joined the pool, the last LOST_AFTER_CHECKS failed, and one more made now fails too; None
    otherwise. A replica reached before and silent now is the pool's to fail over from (a host cut
    off), not a configuration to refuse."""
    member = gw.backends.samplers.members.get(address)
    if member is None or member.reached or member.failed_checks < LOST_AFTER_CHECKS:
        return None
    try:
        await health_pb2_grpc.HealthStub(member.channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=_CHECK_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        return f"its last {member.failed_checks} health checks failed, and one made now: {e.code().name}: {e.details()}"
    return None         # it answers, serving or not (still starting, or stopping)


@router.post("/deregister")
async def deregister(request: Request, gw: GatewayDep) -> dict:
    replica = await _replica(request)
    await gw.db.run(gw.db.delete, SamplerReplicaRow, replica.address)
    return {"status": "deregistered"}


@router.get("/list")
async def listing(request: Request, gw: GatewayDep) -> dict:
    """The pool as this gateway sees it: each replica, live or not, and how many samples it
    answered (for operators and tests; the service token, like registering)."""
    return {"samplers": gw.backends.samplers.listing()}
