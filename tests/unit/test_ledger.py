"""The trainer's ledger (trainer_service/ledger.py) on its own, with a fake engine: the order of
`Ledger.run`'s steps (seq turn, stored reply, resume, work in the fair turn, journal, durable
write, reply kept), at most one run per (model_id, seq_id), a resend answered with the first
reply, a late copy whose reply is gone refused, a model brought back from disk squared with its
journal, and PushWeights' transfer outside the fair turn but inside the seq turn."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import types

import pytest

from tinkerd.errors import LostWorkError, UserError
from tinkerd.v1 import trainer_pb2
from trainer_service.durable import DurableModels
from trainer_service.ledger import Ledger
from trainer_service.replies import ReplyCache
from trainer_service.scheduler import FairScheduler

TURN = "fair-scheduler"        # the scheduler's thread: work in it is in a fair turn


class FakeEngine:
    """The engine as the ledger sees it (ledger.Models): models resident or waiting on disk at a
    state; every call noted in `log` with the thread it ran on."""

    def __init__(self, durable: DurableModels, log: list):
        self.durable, self.log = durable, log
        self.resident: set[str] = set()
        self.on_disk_at: dict[str, tuple[int, int]] = {}      # model_id -> (state_seq, step)

    def is_resident(self, model_id):
        return model_id in self.resident

    def on_disk(self, model_id):
        return model_id in self.on_disk_at

    def get(self, model_id):
        if model_id not in self.resident:
            self.log.append(("resume", threading.current_thread().name))
            self.resident.add(model_id)
        state_seq, step = self.on_disk_at[model_id]
        return types.SimpleNamespace(state_seq=state_seq, step=step)

    def save_durable(self, model_id):
        journaled = [e.seq for e in self.durable.journal(model_id)]
        self.log.append(("write", journaled, threading.current_thread().name))


def _ledger(tmp_path, interval_s=0.0):
    log = []
    durable = DurableModels(str(tmp_path), interval_s)
    return Ledger(durable, FakeEngine(durable, log), FairScheduler()), log


@pytest.fixture
def ledger(tmp_path):
    return _ledger(tmp_path)[0]


def _req(seq, model_id="m"):
    return types.SimpleNamespace(model_id=model_id, seq_id=seq)


def _journal(ledger, model_id="m"):
    return [(e.seq, e.kind, e.reply is not None) for e in ledger.durable.journal(model_id)]


def test_run_takes_its_steps_in_order(tmp_path):
    """A model waiting on disk (state at seq_id 2) gets an optim_step: brought back in the fair
    turn, then the work, then its journal line with the reply, then the durable write (interval
    0: before the reply), all in the turn; the reply kept, so a resend runs nothing."""
    ledger, log = _ledger(tmp_path)
    ledger.durable.record("m", 1, "forward_backward")
    ledger.durable.record("m", 2, "optim_step", trainer_pb2.OptimStepResponse().SerializeToString())
    ledger.models.on_disk_at["m"] = (2, 1)

    def step():
        log.append(("work", _journal(ledger)[-1][0], threading.current_thread().name))
        return trainer_pb2.OptimStepResponse(metrics={"step:max": 2.0})
    reply = ledger.run(_req(3), "optim_step", step, tenant="t")
    assert log == [("resume", TURN), ("work", 2, TURN), ("write", [1, 2, 3], TURN)]
    assert _journal(ledger) == [(1, "forward_backward", False), (2, "optim_step", True), (3, "optim_step", True)]
    assert ledger.run(_req(3), "optim_step", step, tenant="t") == reply and len(log) == 3
    assert ledger.run(_req(2), "optim_step", step, tenant="t") == trainer_pb2.OptimStepResponse()  # from the journal


def test_the_kind_decides_what_is_journaled(ledger):
    """forward_backward: a line; optim_step: a line with its reply; forward, save_state and
    push_weights change no model's state: none."""
    ledger.created("m")
    ledger.run(_req(1), "forward_backward", trainer_pb2.ForwardBackwardResponse, tenant="t")
    ledger.run(_req(2), "forward", trainer_pb2.ForwardBackwardResponse, tenant="t")
    ledger.run(_req(3), "optim_step", trainer_pb2.OptimStepResponse, tenant="t")
    ledger.run(_req(4), "save_state", trainer_pb2.SaveStateResponse, tenant="t")
    ledger.run(_req(5), "push_weights", lambda: "gathered", tenant="t",
               outside_turn=lambda _: trainer_pb2.PushWeightsResponse())
    assert _journal(ledger) == [(1, "forward_backward", False), (3, "optim_step", True)]
    with pytest.raises(ValueError, match="journaled in its turn"):
        ledger.run(_req(6), "optim_step", trainer_pb2.OptimStepResponse, tenant="t", outside_turn=lambda r: r)


def test_an_interval_write_follows_the_reply(tmp_path):
    """With --durable-interval-s above 0, the write a step makes due comes after its reply, as
    the tenant's next turn: held here, the step is answered all the same."""
    ledger, log = _ledger(tmp_path, interval_s=0.01)
    ledger.created("m")
    release, write = threading.Event(), ledger.models.save_durable
    ledger.models.save_durable = lambda model_id: release.wait(10) and write(model_id)
    ledger.run(_req(1), "optim_step", trainer_pb2.OptimStepResponse, tenant="t")
    assert log == []
    release.set()
    deadline = time.monotonic() + 10
    while not log:
        assert time.monotonic() < deadline, "the write never came"
        time.sleep(0.01)
    assert log == [("write", [1], TURN)]


def test_a_request_runs_once_and_a_resend_gets_its_reply(ledger):
    ledger.created("m")
    runs = []

    def step():
        runs.append(1)
        return trainer_pb2.OptimStepResponse(metrics={"step:max": float(len(runs))})
    first = ledger.run(_req(1), "optim_step", step, tenant="t")
    again = ledger.run(_req(1), "optim_step", step, tenant="t")
    assert runs == [1] and again == first
    with pytest.raises(UserError, match="already used by a optim_step"):
        ledger.run(_req(1), "push_weights", step, tenant="t")          # one seq_id, one request


def test_a_late_copy_whose_reply_is_gone_is_refused_not_run_again(ledger):
    ledger.created("m")
    ledger.replies = ReplyCache(per_model_bytes=1)          # keeps only the newest reply
    runs = []
    for seq in (1, 2):
        ledger.run(_req(seq), "forward_backward",
                   lambda: runs.append(seq) or trainer_pb2.ForwardBackwardResponse(), tenant="t")
    with pytest.raises(UserError, match="not applied twice"):
        ledger.run(_req(1), "forward_backward", lambda: runs.append("again"), tenant="t")
    assert runs == [1, 2]


def test_a_failed_request_may_run_again(ledger):
    ledger.created("m")

    def fails():
        raise RuntimeError("the engine failed")
    with pytest.raises(RuntimeError):
        ledger.run(_req(1), "optim_step", fails, tenant="t")
    assert _journal(ledger) == []
    assert ledger.run(_req(1), "optim_step", trainer_pb2.OptimStepResponse, tenant="t").metrics == {}


def test_a_resumed_model_answers_from_its_journal_and_reports_lost_work_once(ledger):
    reply = trainer_pb2.OptimStepResponse(metrics={"step:max": 2.0})
    ledger.durable.record("m", 1, "forward_backward")
    ledger.durable.record("m", 2, "optim_step", reply.SerializeToString())
    ledger.durable.record("m", 3, "forward_backward")       # after the durable state (seq 2): lost
    ledger.durable.record("m", 4, "forward_backward")
    ledger.models.on_disk_at["m"] = (2, 1)
    runs = []

    def forward():
        runs.append(5)
        return trainer_pb2.ForwardBackwardResponse()
    with pytest.raises(LostWorkError, match=r"step 1 \(seq_id 2\).*forward_backward seq_id 3, 4"):
        ledger.run(_req(5), "forward", forward, tenant="t")
    assert runs == []
    assert ledger.run(_req(2), "optim_step", forward, tenant="t") == reply     # a resend of seq 2 is answered
    with pytest.raises(UserError, match="applied before the trainer restarted"):
        ledger.run(_req(1), "forward_backward", forward, tenant="t")           # its reply not kept: never twice
    ledger.run(_req(5), "forward", forward, tenant="t")                    # said once: now it runs
    assert runs == [5] and [e.seq for e in ledger.durable.journal("m")] == [1, 2]


def test_the_resend_of_the_one_lost_request_redoes_it(ledger):
    ledger.durable.record("m", 1, "optim_step", trainer_pb2.OptimStepResponse().SerializeToString())
    ledger.durable.record("m", 2, "forward_backward")       # in flight when the trainer died
    ledger.models.on_disk_at["m"] = (1, 1)
    ledger.run(_req(2), "forward_backward", trainer_pb2.ForwardBackwardResponse, tenant="t")   # no error: redone
    assert _journal(ledger) == [(1, "optim_step", True), (2, "forward_backward", False)]


def test_a_push_transfers_outside_the_fair_turn_but_in_its_seq_turn(ledger):
    """The gather runs in the fair turn; the transfer after it, so another tenant's work runs
    meanwhile; the model's next seq_id waits for the transfer."""
    ledger.created("m")
    threads, release, transferring = [], threading.Event(), threading.Event()

    def transfer(gathered):
        threads.append(threading.current_thread().name)
        transferring.set()
        release.wait(10)
        return trainer_pb2.PushWeightsResponse(snapshot_id=gathered)

    def gather():
        threads.append(threading.current_thread().name)
        return "m@1"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        push = pool.submit(ledger.run, _req(1), "push_weights", gather, tenant="t", outside_turn=transfer)
        assert transferring.wait(10)
        assert ledger.turns.run("other", lambda: "ran") == "ran"         # the fair turn is free
        nxt = pool.submit(ledger.run, _req(2), "forward_backward", trainer_pb2.ForwardBackwardResponse, tenant="t")
        time.sleep(0.1)
        assert not nxt.done()                                           # seq 2 waits for the push
        release.set()
        assert push.result(10).snapshot_id == "m@1"
        nxt.result(10)
    assert threads[0] == TURN and threads[1] != TURN
    assert ledger.run(_req(1), "push_weights", gather, tenant="t", outside_turn=transfer).snapshot_id == "m@1"
    assert len(threads) == 2


def test_the_work_is_called_by_the_scheduler_itself(ledger):
    """The ledger's steps of the turn (`_resume`, `_journal`) are calls around the work, not frames
    above it: the engine call's caller is the scheduler's loop, and its reply is made after it."""
    import sys

    ledger.created("m")
    callers, seconds = [], []

    def work():
        callers.append(sys._getframe(1).f_code.co_qualname)
        return {"loss:sum": 1.0}
    reply = ledger.run(_req(1), "optim_step", work, tenant="t",
                       reply=lambda m: trainer_pb2.OptimStepResponse(metrics=m), ran=seconds.append)
    assert callers == ["FairScheduler._loop"] and reply.metrics == {"loss:sum": 1.0} and len(seconds) == 1
    assert _journal(ledger) == [(1, "optim_step", True)]
    assert ledger.run(_req(1), "optim_step", work, tenant="t", ran=seconds.append) == reply
    assert len(callers) == len(seconds) == 1          # a resend: answered, nothing ran, nothing timed
