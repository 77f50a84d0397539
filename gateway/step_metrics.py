"""Per-step training metrics, recorded when a training job's result is known and read by the
console (gateway/console/) to draw a run's curves.

Every forward_backward, forward and optim_step of a run leaves one small row (StepMetricRow): the
metrics the trainer returned ("loss:sum", "step:max", "grad_norm:mean", ...) plus what the
request itself says (tokens, the weighted-token count, the learning rate). `step` is the
optimizer step a request belongs to: the forward_backwards before an optim_step share its step.
The trainer runs a run's requests in seq_id order, and they are recorded as their replies come
(a step may be sent while the one before it runs, gateway/futures/order.py, but its reply comes
after), so the run's latest row before a request gives it.

Written on every training request, so it is one prebuilt INSERT ... SELECT: the step is read by
an indexed lookup inside the insert, in the transaction that finishes the request's future (no
transaction of its own).
"""

from __future__ import annotations

import logging

from sqlalchemy import JSON, DateTime, bindparam, case, func, literal, select, true
from sqlalchemy.dialects import postgresql, sqlite

from gateway.storage.db import Database, StepMetricRow, now
from gateway.storage.prepared import Prepared
from tinkerd.tensors import to_numpy
from tinkerd.v1 import trainer_pb2

log = logging.getLogger(__name__)

_ROWS = StepMetricRow.__table__.c
# The step of the run's latest row before this one, plus one if that row was an optim_step.
_PREVIOUS_STEP = (select(_ROWS.step + case((_ROWS.kind == "optim_step", 1), else_=0))
                  .where(_ROWS.model_id == bindparam("model_id"), _ROWS.seq_id < bindparam("seq_id"))
                  .order_by(_ROWS.seq_id.desc()).limit(1).scalar_subquery())
def _insert(dialect):
    """The row, unless the request has one (a job run again: the first one stands)."""
    values = select(bindparam("model_id", type_=_ROWS.model_id.type), bindparam("seq_id", type_=_ROWS.seq_id.type),
                    bindparam("kind", type_=_ROWS.kind.type), bindparam("metrics", type_=JSON),
                    bindparam("at", type_=DateTime(timezone=True)), func.coalesce(_PREVIOUS_STEP, literal(1)))
    # SQLite reads `ON CONFLICT` after a bare SELECT as the SELECT's own: a WHERE comes between.
    return dialect.insert(StepMetricRow.__table__).from_select(
        ["model_id", "seq_id", "kind", "metrics", "at", "step"], values.where(true())).on_conflict_do_nothing()


_INSERTS = {"postgresql": Prepared(_insert(postgresql)), "sqlite": Prepared(_insert(sqlite))}


def recorder(request, reply):
    """A finished forward_backward/forward (ForwardBackwardRequest/Response) or optim_step
    (OptimStepRequest/Response), as a function of the connection that writes its row: run in the
    transaction that finishes the request's future (gateway/jobs/base.py Done.records). None if
    they cannot be made: metrics are for display, a failure to record is logged, never the job's."""
    try:
        values = _values(request, reply)
    except Exception:  # noqa: BLE001 - the training result must still go out
        log.exception("could not record step metrics of %s seq %s", request.model_id, request.seq_id)
        return None

    def write(conn) -> None:
        _INSERTS["postgresql" if conn.dialect.name == "postgresql" else "sqlite"].rowcount(conn, values)
    return write


def _values(request, reply) -> dict:
    if isinstance(request, trainer_pb2.ForwardBackwardRequest):
        kind = "forward" if request.forward_only else "forward_backward"
        metrics = {**dict(reply.metrics), **_request_counts(request)}
        if metrics.get("weights:sum", 0) > 0 and "loss:sum" in metrics:
            metrics["loss:mean"] = metrics["loss:sum"] / metrics["weights:sum"]   # comparable across batch sizes
    elif isinstance(request, trainer_pb2.OptimStepRequest):
        kind = "optim_step"
        params = request.dimuon_params if request.HasField("dimuon_params") else request.adam_params
        metrics = {**dict(reply.metrics), "learning_rate": params.learning_rate}
    else:
        raise TypeError(f"not a training request: {type(request).__name__}")
    return {"model_id": request.model_id, "seq_id": request.seq_id, "kind": kind, "metrics": metrics, "at": now()}


def _request_counts(request: trainer_pb2.ForwardBackwardRequest) -> dict[str, float]:
    """Tokens in the batch and, where the loss has per-token weights, their sum."""
    counts = {"tokens:sum": float(sum(len(d.tokens) for d in request.data)), "datums:sum": float(len(request.data))}
    weights = [d.loss_fn_inputs["weights"] for d in request.data if "weights" in d.loss_fn_inputs]
    if weights:
        counts["weights:sum"] = float(sum(to_numpy(w).sum() for w in weights))
    return counts


def of_run(db: Database, model_id: str) -> list[StepMetricRow]:
    """A run's rows in seq_id order."""
    return db.select(select(StepMetricRow).where(StepMetricRow.model_id == model_id)
                     .order_by(StepMetricRow.seq_id))

