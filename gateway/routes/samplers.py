"""Sampler replicas joining and leaving the pool (gateway/sampler_pool.py). Not Tinker: called by
`tinkerd sampler --register-with URL`, authenticated with the service token that the gRPC calls
between services use (without one, only from this machine): gateway/identity/auth.py checks it before any
route, or any body, is read."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, ValidationError

from gateway.protocol import parse_json
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
    if not gw.db.touch(SamplerReplicaRow, replica.address, last_seen=now()):
        gw.db.put(SamplerReplicaRow(address=replica.address))
    return {"status": "registered"}


@router.post("/deregister")
async def deregister(request: Request, gw: GatewayDep) -> dict:
    replica = await _replica(request)
    gw.db.delete(SamplerReplicaRow, replica.address)
    return {"status": "deregistered"}


@router.get("/list")
async def listing(request: Request, gw: GatewayDep) -> dict:
    """The pool as this gateway sees it: each replica, live or not, and how many samples it
    answered (for operators and tests; the service token, like registering)."""
    return {"samplers": gw.backends.samplers.listing()}
