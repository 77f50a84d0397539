"""The trainer's ledger (trainer_service/ledger.py) on its own: at most one run per (model_id,
seq_id), a resend answered with the first reply, a late copy whose reply is gone refused, and a
model brought back from disk squared with its journal."""

from __future__ import annotations

import pytest

from tinkerd.errors import LostWorkError, UserError
from tinkerd.v1 import trainer_pb2
from trainer_service.durable import DurableModels
from trainer_service.ledger import Ledger
from trainer_service.replies import ReplyCache


@pytest.fixture
def ledger(tmp_path):
    return Ledger(DurableModels(str(tmp_path)))


def test_a_request_runs_once_and_a_resend_gets_its_reply(ledger):
    ledger.created("m")
    runs = []

    def step():
        runs.append(1)
        return trainer_pb2.OptimStepResponse(metrics={"step:max": float(len(runs))})
    first = ledger.once("m", 1, "optim_step", step)
    again = ledger.once("m", 1, "optim_step", step)
    assert runs == [1] and again == first
    with pytest.raises(UserError, match="already used by a optim_step"):
        ledger.once("m", 1, "push_weights", step)          # one seq_id, one request


def test_a_late_copy_whose_reply_is_gone_is_refused_not_run_again(ledger):
    ledger.created("m")
    ledger.replies = ReplyCache(per_model_bytes=1)          # keeps only the newest reply
    runs = []
    for seq in (1, 2):
        ledger.once("m", seq, "forward_backward", lambda: runs.append(seq) or trainer_pb2.ForwardBackwardResponse())
    with pytest.raises(UserError, match="not applied twice"):
        ledger.once("m", 1, "forward_backward", lambda: runs.append("again"))
    assert runs == [1, 2]


def test_a_failed_request_may_run_again(ledger):
    ledger.created("m")

    def fails():
        raise RuntimeError("the engine failed")
    with pytest.raises(RuntimeError):
        ledger.once("m", 1, "optim_step", fails)
    assert ledger.once("m", 1, "optim_step", trainer_pb2.OptimStepResponse).metrics == {}


def test_resume_gives_journaled_replies_back_and_reports_lost_work_once(ledger):
    reply = trainer_pb2.OptimStepResponse(metrics={"step:max": 2.0})
    ledger.record("m", 1, "forward_backward")
    ledger.record("m", 2, "optim_step", reply.SerializeToString())
    ledger.record("m", 3, "forward_backward")              # after the durable state (seq 2): lost
    ledger.record("m", 4, "forward_backward")
    with pytest.raises(LostWorkError, match="forward_backward seq_id 3, 4"):
        ledger.resume("m", 5, state_seq=2, step=1)
    assert ledger.stored("m", 2, "optim_step") == reply     # a resend of seq 2 is answered
    with pytest.raises(UserError, match="applied before the trainer restarted"):
        ledger.stored("m", 1, "forward_backward")          # applied, its reply not kept: never twice
    ledger.resume("m", 5, state_seq=2, step=1)              # said once: the journal was trimmed


def test_the_resend_of_the_one_lost_request_redoes_it(ledger):
    ledger.record("m", 1, "optim_step", trainer_pb2.OptimStepResponse().SerializeToString())
    ledger.record("m", 2, "forward_backward")              # in flight when the trainer died
    ledger.resume("m", 2, state_seq=1, step=1)              # no error: this is that request again
    assert [e.seq for e in ledger.durable.journal("m")] == [1]
