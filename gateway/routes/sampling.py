"""Sampling: sampling sessions (over the base model or a sampler checkpoint) and asample."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from gateway import bodies, convert
from gateway.futures.store import new_request_id
from gateway.jobs.engine import fingerprint
from gateway.identity import audit
from gateway.identity.auth import CallerDep, caller_of
from gateway.jobs.sampling import Sample, SampleOf
from gateway.storage.db import Database, ModelRow, SamplingSessionRow
from gateway.protocol import (CreateSamplingSessionRequest, CreateSamplingSessionResponse, FutureResponse,
                              GetSamplerResponse, JoinSamplingSessionRequest, SAMPLING_CLONE_SPAN, SampleRequest)
from gateway.state import GatewayDep, gateway_of
from tinkerd.errors import UserError

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(body: CreateSamplingSessionRequest, caller: CallerDep,
                                  gw: GatewayDep) -> CreateSamplingSessionResponse:
    """Over the base model, or over a sampler checkpoint that is the caller's or published."""
    session_id = await gw.sessions.open(caller, body.session_id)
    sid = f"{session_id}:sample:{body.sampling_session_seq_id}"
    if body.model_path:
        ckpt = await gw.sessions.readable_checkpoint(caller, body.model_path)
        if ckpt.checkpoint_type != "sampler":
            raise UserError(f"{body.model_path!r} is not a sampler checkpoint (save_weights_for_sampler makes one)")
        await gw.db.run(audit.read_by_other_user, gw.db, caller, ckpt, "create_sampling_session")
        base, snapshot, snapshot_path = (await gw.db.row(ModelRow, ckpt.model_id)).base_model, ckpt.snapshot_id, \
            ckpt.snapshot_path
    else:
        base, snapshot, snapshot_path = gw.settings.supported_base_model(body.base_model), "", ""
    row = SamplingSessionRow(sampling_session_id=sid, session_id=session_id, owner=caller.user_id,
                             base_model=base, model_path=body.model_path, snapshot_id=snapshot,
                             snapshot_path=snapshot_path)
    await gw.db.run(_add_sampling_session, gw.db, row, gw.limits.admit_sampling_session(caller))
    return CreateSamplingSessionResponse(sampling_session_id=sid)


def _add_sampling_session(db: Database, row: SamplingSessionRow, admit) -> None:
    """Inserts the sampling session if it is new, `admit` checking --max-sampling-sessions-per-user.
    Made meanwhile by a concurrent request (a create, or a save_weights_for_sampler with this seq
    id): a resend of this very request is answered as the first, anything else refused."""
    if db.get(SamplingSessionRow, row.sampling_session_id) is None and not db.add_admitted(row, admit):
        _same_sampling_session(db.get(SamplingSessionRow, row.sampling_session_id), row)


def _same_sampling_session(existing: SamplingSessionRow, wanted: SamplingSessionRow) -> None:
    if (existing.owner, existing.model_path, existing.snapshot_id) != (wanted.owner, wanted.model_path,
                                                                       wanted.snapshot_id):
        raise UserError(f"sampling session {wanted.sampling_session_id} exists already with other weights: every "
                        f"sampling session needs its own sampling_session_seq_id")


@router.get("/samplers/{sampler_id:path}")
async def get_sampler(sampler_id: str, caller: CallerDep, gw: GatewayDep) -> GetSamplerResponse:
    row = await gw.sessions.sampling_session(caller, sampler_id)
    return GetSamplerResponse(sampler_id=row.sampling_session_id, base_model=row.base_model, model_path=row.model_path)


@router.post("/join_sampling_session")
async def join_sampling_session(body: JoinSamplingSessionRequest, caller: CallerDep, gw: GatewayDep) -> dict:
    """An unpickled SamplingClient's clone id, unique in its sampling session (the original is 0):
    its request seq_ids (clone id x SAMPLING_CLONE_SPAN + k) never collide with another clone's."""
    await gw.sessions.live_sampling_session(caller, body.sampling_session_id)
    clone = await asyncio.to_thread(gw.db.next_clone, body.sampling_session_id)
    if clone >= SAMPLING_CLONE_SPAN:
        raise UserError(f"sampling session {body.sampling_session_id} has had {SAMPLING_CLONE_SPAN - 1} clones; "
                        f"make a new SamplingClient")
    return {"type": "join_sampling_session", "client_counter": clone}


@router.post("/asample")
async def asample(request: Request):
    """Hot: called from the edge directly (gateway/edge.py)."""
    caller, gw = caller_of(request), gateway_of(request)
    body = await bodies.model_of(request, SampleRequest)       # a long prompt is parsed off the loop
    session = await gw.sessions.live_sampling_session(caller, body.sampling_session_id)
    convert.check_sample(body, convert.model_limits(gw.settings.base_model, gw.settings.max_model_len))
    snapshot_id, snapshot_path, cache_namespace = await gw.sessions.weights(session)
    msg = convert.sample_request(body, snapshot_id, snapshot_path)
    msg.cache_namespace = cache_namespace
    await gw.sessions.used(session)
    record_for = session.session_id if body.record_stability_info else None
    msg.request_id = new_request_id()      # the future's id (a resend gets the first one's back)
    job = Sample(msg, record_for, SampleOf(caller.user_id, session.session_id, session.base_model))
    with gw.traces.refusals(session.session_id, "sample"):       # a 429 is in the session's trace
        row = await gw.jobs.submit(job, caller, fingerprint=fingerprint("sample", body.model_dump_json()),
                                   idempotency_key=f"{body.sampling_session_id}#{body.seq_id}",
                                   target=(body.sampling_session_id, body.seq_id // SAMPLING_CLONE_SPAN),
                                   request_id=msg.request_id, admit=gw.limits.admit_sample(caller))
    return FutureResponse(request_id=row.request_id,
                          sample_sequence_ids=[f"{row.request_id}:{i}" for i in range(body.num_samples)])
