"""Service-level calls: client configuration, health, capabilities, telemetry."""

from __future__ import annotations

import asyncio

import grpc
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.state import GatewayDep
from tinkerd.v1 import common_pb2

router = APIRouter(prefix="/api/v1")

# What the SDK switches on or off: only transports and features this server implements.
# With auth on, the SDK exchanges its API key for a JWT (routes/identity.py) and whoami works.
# sample_use_retrieve_futures: SDK >= 0.28 polls one retrieve_futures per sampling session in
# place of one retrieve_future per sample (routes/futures.py); older SDKs ignore it.
CLIENT_CONFIG = {"use_pyqwest_transport": False, "proto_compress_fwdbwd": True,
                 "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": True,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}


@router.post("/client/config")
async def client_config(gw: GatewayDep) -> dict:
    return {**CLIENT_CONFIG, "pjwt_auth_enabled": gw.settings.auth}


# sample_cancel_enabled: SDK >= 0.26 sends cancel_future for a sample it abandons (routes/futures.py).
DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": True, "sample_cancel_max_batch_size": 64}


@router.post("/client/dynamic_config")
async def dynamic_config() -> dict:
    return DYNAMIC_CONFIG


@router.post("/telemetry")
async def telemetry() -> dict:
    return {"status": "accepted"}


@router.get("/healthz")
async def healthz(gw: GatewayDep):
    services = [gw.backends.trainer, *gw.backends.samplers]
    try:
        replies = await asyncio.gather(*(s.Health(common_pb2.HealthRequest(), timeout=5) for s in services))
    except grpc.aio.AioRpcError as e:
        return JSONResponse({"status": "unavailable", "detail": e.details()}, status_code=503)
    if not all(r.ready for r in replies):
        return JSONResponse({"status": "starting"}, status_code=503)
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(gw: GatewayDep) -> dict:
    return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                 for name in gw.settings.model_names]}
