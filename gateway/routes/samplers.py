"""Sampler replicas joining and leaving the pool (gateway/sampler_pool.py). Not Tinker: called by
`tinkerd sampler --register-with URL`, authenticated with the service token that the gRPC calls
between services use (without one, only from this machine)."""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field

from gateway.db import SamplerReplicaRow, now
from gateway.state import GatewayDep
from tinkerd.rpc import ServiceAuth

router = APIRouter(prefix="/internal/v1/samplers")


class Replica(BaseModel):
    address: str = Field(min_length=3, max_length=256, pattern=r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$")


def _check_service(request: Request, auth: ServiceAuth) -> None:
    if auth.token:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {auth.token}".encode()):
            raise HTTPException(401, "missing or wrong service token")
    elif not (request.client and ipaddress.ip_address(request.client.host).is_loopback):
        raise HTTPException(403, "without a service token, replicas may register from this machine only")


@router.post("/register")
async def register(body: Replica, request: Request, gw: GatewayDep) -> dict:
    """Joins the pool, or heart-beats: a replica re-registers every few seconds."""
    _check_service(request, gw.service_auth)
    if not gw.db.touch(SamplerReplicaRow, body.address, last_seen=now()):
        gw.db.put(SamplerReplicaRow(address=body.address))
    return {"status": "registered"}


@router.post("/deregister")
async def deregister(body: Replica, request: Request, gw: GatewayDep) -> dict:
    _check_service(request, gw.service_auth)
    gw.db.delete(SamplerReplicaRow, body.address)
    return {"status": "deregistered"}
