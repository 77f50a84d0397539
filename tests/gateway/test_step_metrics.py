"""A run's step metrics rows (gateway/step_metrics.py), written by one prebuilt INSERT ... SELECT
that reads the step of the run's previous row, in the transaction finishing the request's future: right on SQLite and Postgres, when two gateways
on one database record a run's requests in turn, and when a request is recorded twice (a job
re-driven after a restart: the first row stands)."""

import numpy as np
import pytest

from gateway import step_metrics
from gateway.storage.db import Database
from tinkerd.tensors import from_numpy
from tinkerd.v1 import common_pb2, trainer_pb2


def _forward_backward(model_id: str, seq_id: int, loss: float, forward_only=False):
    weights = from_numpy(np.array([0.0, 1.0, 1.0], np.float32))
    request = trainer_pb2.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_only=forward_only,
                                                 data=[common_pb2.Datum(tokens=[5, 6, 7],
                                                                        loss_fn_inputs={"weights": weights})])
    return request, trainer_pb2.ForwardBackwardResponse(metrics={"loss:sum": loss})


def _optim_step(model_id: str, seq_id: int, lr: float):
    request = trainer_pb2.OptimStepRequest(model_id=model_id, seq_id=seq_id,
                                           adam_params=common_pb2.AdamParams(learning_rate=lr))
    return request, trainer_pb2.OptimStepResponse(metrics={"step:max": 1.0})


def _record(db: Database, request, reply) -> None:
    """As a training job's future is finished: its row written in that transaction."""
    with db.engine.begin() as conn:
        step_metrics.recorder(request, reply)(conn)


def test_two_gateways_record_a_run_in_turn_and_a_rerun_keeps_the_first_row(db_url):
    one, two = Database(db_url), Database(db_url)
    run, other = "s:train:0", "s:train:1"
    requests = [_forward_backward(run, 1, 3.0), _forward_backward(run, 2, 1.0), _optim_step(run, 3, 0.01),
                _forward_backward(run, 4, 2.0), _optim_step(run, 5, 0.02), _forward_backward(run, 6, 0.5, True)]
    for i, (request, reply) in enumerate(requests):
        _record((one, two)[i % 2], request, reply)
        _record(one, *_optim_step(other, i + 1, 0.1))     # another run's steps count for it alone
    _record(two, *_forward_backward(run, 2, 99.0))        # re-driven after a restart

    rows = step_metrics.of_run(one, run)
    assert [(r.seq_id, r.step, r.kind) for r in rows] == [
        (1, 1, "forward_backward"), (2, 1, "forward_backward"), (3, 1, "optim_step"),
        (4, 2, "forward_backward"), (5, 2, "optim_step"), (6, 3, "forward")]
    assert rows[1].metrics == {"loss:sum": 1.0, "tokens:sum": 3.0, "datums:sum": 1.0, "weights:sum": 2.0,
                               "loss:mean": 0.5}
    assert rows[2].metrics == {"step:max": 1.0, "learning_rate": pytest.approx(0.01)}
    assert rows[0].at <= rows[-1].at
    assert [r.step for r in step_metrics.of_run(two, other)] == [1, 2, 3, 4, 5, 6]
