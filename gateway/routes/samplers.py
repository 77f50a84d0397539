"""Sampler replicas joining and leaving the pool (gateway/sampler_pool.py). Not Tinker: called by
`tinkerd sampler --register-with URL`, authenticated with the service token that the gRPC calls
between services use (without one, only from this machine)."""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field, ValidationError

from gateway.db import SamplerReplicaRow, now
from gateway.protocol import parse_json
from gateway.state import GatewayDep
from tinkerd.errors import UserError
from tinkerd.rpc import ServiceAuth

router = APIRouter(prefix="/internal/v1/samplers")


class Replica(BaseModel):
    address: str = Field(min_length=3, max_length=256, pattern=r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$")


def _check_service_caller(request: Request, gw) -> None:
    auth: ServiceAuth = gw.service_auth
    if auth.token:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {auth.token}".encode()):
            raise HTTPException(401, "missing or wrong service token")
    elif not (request.client and ipaddress.ip_address(request.client.host).is_loopback):
        raise HTTPException(403, "without a service token, replicas may register from this machine only")


async def _replica(request: Request, gw) -> Replica:
    """The calling replica: its service token checked first (a bad credential is a 401 whatever
    the body), then its body."""
    _check_service_caller(request, gw)
    try:
        return Replica.model_validate(parse_json(await request.body()))
    except ValidationError as e:
        raise UserError(f"a replica is {{\"address\": \"host:port\"}}: {e.errors()[0]['msg']}") from None


@router.post("/register")
async def register(request: Request, gw: GatewayDep) -> dict:
    """Joins the pool, or heart-beats: a replica re-registers every few seconds."""
    replica = await _replica(request, gw)
    if not gw.db.touch(SamplerReplicaRow, replica.address, last_seen=now()):
        gw.db.put(SamplerReplicaRow(address=replica.address))
    return {"status": "registered"}


@router.post("/deregister")
async def deregister(request: Request, gw: GatewayDep) -> dict:
    replica = await _replica(request, gw)
    gw.db.delete(SamplerReplicaRow, replica.address)
    return {"status": "deregistered"}


@router.get("/list")
async def listing(request: Request, gw: GatewayDep) -> dict:
    """The pool as this gateway sees it: each replica, live or not, and how many samples it
    answered (for operators and tests; the service token, like registering)."""
    _check_service_caller(request, gw)
    return {"samplers": gw.backends.samplers.listing()}
