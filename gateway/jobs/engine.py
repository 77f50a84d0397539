"""What the routes hand work to: one `submit` for every request that becomes a future (the shape of
vLLM's EngineClient). A route checks and translates its body, makes the typed job
(gateway/jobs/) and submits it here; the futures (gateway/futures/store.py) record, order, run
and finish it.

A model's request (a `seq_id`) runs in the model's seq_id order, counted against its owner's
training queue; others (samples, custom losses, no-ops) run as they come, admitted by what the
route names (`admit`: gateway/identity/limits.py). A model's request refused by its route still
takes its turn (`refuse`), so the model's next request waits for nobody.
"""

from __future__ import annotations

import hashlib
import typing
from typing import Callable

from gateway.identity.caller import Caller
from gateway.jobs.base import Job
from gateway.jobs.refused import Refused
from gateway.storage.db import Database, FutureRow, ModelRow, aware, now
from gateway.traces.spans import session_of
from tinkerd.errors import ServiceError

if typing.TYPE_CHECKING:         # the parts it is built from (gateway/state.py builds it)
    from sqlalchemy.engine import Connection

    from gateway.futures.completions import Target
    from gateway.futures.store import Futures
    from gateway.identity.limits import Limits
    from gateway.settings import GatewaySettings

# A model's last_request_time is written at most this often (one write per request is too many).
_REQUEST_TIME_RESOLUTION_S = 5.0


def fingerprint(kind: str, request: bytes | str) -> str:
    """What identifies a request's content, to tell a resend from another request."""
    data = request.encode() if isinstance(request, str) else request
    return hashlib.sha256(kind.encode() + b"\0" + data).hexdigest()


class Jobs:
    def __init__(self, futures: "Futures", limits: "Limits", db: Database, settings: "GatewaySettings"):
        self.futures, self.limits, self.db, self.settings = futures, limits, db, settings

    async def submit(self, job: Job, caller: Caller, *, model_id: str | None = None, seq_id: int | None = None,
                     fingerprint: str | None = None, idempotency_key: str | None = None,
                     target: "Target | None" = None, request_id: str | None = None,
                     admit: "Callable[[Connection], None] | None" = None) -> FutureRow:
        """The job's future (a resend, same key and same `fingerprint`, gets the first one back)."""
        if seq_id is None:
            return await self.futures.submit(job, owner=caller.user_id, fingerprint=fingerprint,
                                             idempotency_key=idempotency_key, target=target, request_id=request_id,
                                             admit=admit)
        with self.futures.traces.refusals(session_of(model_id, None), job.kind()):    # a 429 is in its trace
            row = await self.futures.submit(job, owner=caller.user_id, fingerprint=fingerprint,
                                            idempotency_key=f"{model_id}#{seq_id}", model_id=model_id, seq_id=seq_id,
                                            admit=admit or self.limits.admit_training(caller, job.kind(), model_id))
        await self.db.run(self._used, model_id)
        return row

    async def refuse(self, caller: Caller, model_id: str, seq_id: int, error: str) -> None:
        """The model's seq_id is taken by a refusal (jobs/training.py Refused). A resend of it gets
        the first one back; a seq_id another request holds needs no record."""
        try:
            await self.futures.submit(Refused(model_id, seq_id, error), owner=caller.user_id,
                                      fingerprint=fingerprint("refused", error), idempotency_key=f"{model_id}#{seq_id}",
                                      model_id=model_id, seq_id=seq_id)
        except ServiceError:
            pass

    def _used(self, model_id: str) -> None:
        """The model is in use: it is not unloaded as idle (finer than the session timeout:
        db.models_of_lapsed_sessions), and it is resident again."""
        model = self.db.get(ModelRow, model_id)
        stamp = now()
        resolution = min(_REQUEST_TIME_RESOLUTION_S, self.settings.session_timeout_s / 3)
        if model is not None and (not model.resident or (stamp - aware(model.last_request_time)).total_seconds()
                                  > resolution):
            self.db.touch(ModelRow, model_id, last_request_time=stamp, resident=True)
