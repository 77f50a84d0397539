"""The trainer executes a model's requests in seq_id order whichever gateway sends them
(trainer_service/seq_order.py): out-of-order arrivals wait for the lower seq_ids, a seq_id that
never comes holds the next one only up to the gap timeout, and a copy of a request that arrives
while the first still runs (a re-drive from another gateway) gets the first one's reply."""

import concurrent.futures
import os
import threading
import time

from trainer_service.seq_order import SeqOrder
import pytest

from servicer_context import Context
from test_durable import TOKENS, _create, _datum, _fb, _step, _trainer
from tinkerd.v1 import trainer_pb2


def _run_in_threads(calls):
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = []
        for fn in calls:
            futures.append(pool.submit(fn))
            time.sleep(0.05)           # arrival order as listed
        return [f.result(timeout=60) for f in futures]


def _request_of(order: SeqOrder, ran: list[int]):
    """A request of model "m" as a callable: waits its turn, notes that it ran, is done."""
    def request(seq):
        def go():
            order.wait_turn("m", seq)
            ran.append(seq)
            order.executed("m", seq)
        return go
    return request


def _fb_of(trainer, model_id, seq):
    """A forward_backward whose datum names its seq_id (its tokens shifted by it), so that the
    engine's call says which request it runs."""
    return _fb(trainer, model_id, seq, shift=seq)


def _steps_taken(trainer) -> list[tuple[str, int]]:
    """The engine's forward_backward (of `_fb_of`'s requests) and optim_step calls from now on, in
    the order they ran."""
    ran = []
    real_fb, real_step = trainer.engine.forward_backward, trainer.engine.optim_step

    def fb(model_id, data, *args, **kwargs):
        ran.append(("fb", data[0].tokens[0] - TOKENS[0]))
        return real_fb(model_id, data, *args, **kwargs)

    def step(model_id, adam, **kwargs):
        ran.append(("optim_step", kwargs.get("seq")))
        return real_step(model_id, adam, **kwargs)
    trainer.engine.forward_backward, trainer.engine.optim_step = fb, step
    return ran


def test_seq_order_holds_later_seq_ids_and_gives_up_on_a_gap():
    # A gap timeout far above the threads' spacing while they arrive out of order: under a full
    # suite's load a thread can start half a second late, and 3 would rightly stop waiting.
    order, ran = SeqOrder(gap_timeout_s=30), []
    order.created("m")

    request = _request_of(order, ran)
    _run_in_threads([request(3), request(2), request(1)])
    assert ran == [1, 2, 3]
    order.gap_timeout_s = 0.5
    t0 = time.monotonic()
    request(5)()                      # 4 never comes: 5 runs after the gap timeout
    assert ran[-1] == 5 and 0.4 < time.monotonic() - t0 < 2
    request(4)()                      # late: runs at once (what it would have waited for is done)
    assert ran[-1] == 4


def test_a_copy_of_a_running_request_waits_for_it():
    order, started, release = SeqOrder(gap_timeout_s=5), threading.Event(), threading.Event()
    order.created("m")

    def first():
        order.wait_turn("m", 1)
        started.set()
        release.wait(5)
        order.executed("m", 1)

    def copy():
        started.wait(5)
        t0 = time.monotonic()
        order.wait_turn("m", 1)
        order.executed("m", 1)
        return time.monotonic() - t0
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(first), pool.submit(copy)
        time.sleep(0.3)
        release.set()
        a.result(5)
        assert b.result(5) >= 0.2


def test_the_next_seq_id_waits_for_a_running_one_past_the_gap_timeout():
    """With several gateways, seq N+1 reaches the trainer while N (from another gateway) still
    runs: a long step must not look like a seq_id that never came. N+1 waits for N however long N
    runs, and N stays counted as executed (a late copy of it is told so, not run again)."""
    order, started, release = SeqOrder(gap_timeout_s=0.2), threading.Event(), threading.Event()
    order.created("m")
    ran = []

    def long_step():
        order.wait_turn("m", 1)
        started.set()
        release.wait(5)
        ran.append(1)
        order.executed("m", 1)

    def next_one():
        started.wait(5)
        order.wait_turn("m", 2)
        ran.append(2)
        order.executed("m", 2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(long_step), pool.submit(next_one)
        time.sleep(0.8)                 # 4 gap timeouts while seq 1 runs
        assert ran == [] and not b.done()
        release.set()
        a.result(5), b.result(5)
    assert ran == [1, 2]
    assert order.wait_turn("m", 1) is True      # executed before: a late copy is not applied again
    order.executed("m", 1)


def test_a_restarted_order_resumes_after_the_newest_turn_on_disk(tmp_path):
    """durable.py keeps the newest seq_id whose turn came (any kind, failed and refused ones too);
    a new process's order starts after it, and without it (or with a record that does not check)
    at the first seq_id it sees."""
    from trainer_service.durable import DurableModels

    durable = DurableModels(str(tmp_path))
    os.makedirs(durable.model_dir("m"))
    for seq in (1, 3, 2):                       # a late copy of 2 does not move it back
        durable.note_turn("m", seq)
    assert DurableModels(str(tmp_path)).next_turn("m") == 4
    assert durable.next_turn("no-such-model") is None
    order, ran = SeqOrder(gap_timeout_s=5, start_of=DurableModels(str(tmp_path)).next_turn), []

    request = _request_of(order, ran)
    _run_in_threads([request(5), request(4)])      # 5 first: it waits for 4
    assert ran == [4, 5]
    path = os.path.join(durable.model_dir("m"), "last_seq")
    durable.note_turn("m", 12345)
    durable.note_turn("m", 12346)                # written in place over the last, the same width
    assert durable.next_turn("m") == 12347
    record = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(record[:19] + b"9" + record[20:])      # a machine crash mid-write: a mix of two
    assert durable.next_turn("m") is None               # does not check: as if never written
    with open(path, "w") as f:
        f.write("")                              # cut short by a crash: as if never written
    assert durable.next_turn("m") is None
    with open(path, "w") as f:
        f.write("41")                            # an older trainer's bare number
    assert durable.next_turn("m") == 42
    with open(path, "wb") as f:
        f.write(record[:17])                     # the first write over it, cut short in its digits
    assert durable.next_turn("m") is None
    durable.remove("m")
    assert durable.next_turn("m") is None


def test_the_servicer_runs_out_of_order_requests_in_seq_order_once(tiny_model_dir, tmp_path):
    """The SDK's chunks arrive last-first, spread over two gateways: the optim_step (3) and the
    second chunk (2) wait for the first chunk (1); a copy of chunk 2 sent meanwhile by another
    gateway runs nothing and gets the same reply."""
    from prometheus_client import REGISTRY

    def counted():      # the trainer's metrics count what ran, not the copy answered with its reply
        return [REGISTRY.get_sample_value(name, {"kind": kind}) or 0.0 for name, kind in (
            ("tinkerd_trainer_tokens_total", "forward_backward"),
            ("tinkerd_trainer_step_duration_seconds_count", "forward_backward"),
            ("tinkerd_trainer_step_duration_seconds_count", "optim_step"))]
    trainer = _trainer(tiny_model_dir, tmp_path)
    _create(trainer, "s:train:0")
    ran, before = _steps_taken(trainer), counted()
    step, fb2, fb2_copy, fb1 = _run_in_threads([
        lambda: _step(trainer, "s:train:0", 3), lambda: _fb_of(trainer, "s:train:0", 2),
        lambda: _fb_of(trainer, "s:train:0", 2), lambda: _fb_of(trainer, "s:train:0", 1)])
    assert ran == [("fb", 1), ("fb", 2), ("optim_step", 3)]
    assert fb2_copy == fb2
    assert [after - n for after, n in zip(counted(), before)] == [2 * (len(TOKENS) - 1), 2, 1]
    assert trainer.ledger.order.next_of("s:train:0") == 4
    assert trainer.engine.get("s:train:0").step == 1


def test_a_late_copy_of_an_executed_seq_id_is_told_so():
    """wait_turn says whether the seq_id executed here before: then the servicer refuses it (its
    reply is gone) instead of applying it twice. Seq_ids skipped by the gap timeout and requests
    that failed were not applied, so those may run late."""
    order = SeqOrder(gap_timeout_s=0.2)
    order.created("m")
    for seq in (1, 2):
        assert order.wait_turn("m", seq) is False
        order.executed("m", seq)
    assert order.wait_turn("m", 1) is True           # a re-drive of seq_id 1
    order.executed("m", 1)
    assert order.wait_turn("m", 5) is False          # 3 and 4 never come: skipped after the gap timeout
    order.executed("m", 5)
    assert order.wait_turn("m", 3) is False          # late, never applied: runs
    order.executed("m", 3)
    assert order.wait_turn("m", 3) is True           # but only once
    order.executed("m", 3)
    assert order.wait_turn("m", 6) is False
    order.executed("m", 6, applied=False)            # failed: a resend may run it
    assert order.wait_turn("m", 6) is False
    order.executed("m", 6)
    assert order.wait_turn("m", 6) is True
    order.executed("m", 6)
    fresh = SeqOrder()                                # a restarted trainer: what came before is unknown
    assert fresh.wait_turn("m", 7) is False
    fresh.executed("m", 7)
    assert fresh.wait_turn("m", 2) is False


def test_a_re_drive_whose_reply_was_dropped_is_refused_not_applied_twice(tiny_model_dir, tmp_path):
    import grpc
    from servicer_context import Aborted, answered
    from trainer_service.replies import ReplyCache

    trainer = _trainer(tiny_model_dir, tmp_path)
    trainer.ledger.replies = ReplyCache(per_model_bytes=1)      # keeps only each model's newest reply
    _create(trainer, "s:train:0")
    ran = _steps_taken(trainer)
    first = _fb_of(trainer, "s:train:0", 1)
    first_request = trainer_pb2.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy",
                                                       data=[_datum(1)])
    _fb_of(trainer, "s:train:0", 2)
    assert _fb_of(trainer, "s:train:0", 2) == _fb_of(trainer, "s:train:0", 2)      # still kept: answered
    context = Context()
    with pytest.raises(Aborted, match="seq_id 1 of s:train:0 was already executed .* not applied twice"):
        answered(trainer.ForwardBackward)(first_request, context)
    assert context.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ran == [("fb", 1), ("fb", 2)] and first.outputs


def test_after_a_restart_requests_arriving_out_of_order_still_run_in_order(tiny_model_dir, tmp_path):
    """Two gateways can send a model's optim_step before its forward_backward right after the
    trainer restarted: the restarted trainer resumes the model's order after the newest seq_id the
    last one took (durable.py's last_seq), so 4 waits for 3. (It used to start at the first seq_id
    it saw: 4 ran first, and 3's gradients waited for the next step.)"""
    first = _trainer(tiny_model_dir, tmp_path)
    _create(first, "s:train:0")
    _fb(first, "s:train:0", 1)
    _step(first, "s:train:0", 2)
    trainer = _trainer(tiny_model_dir, tmp_path)        # a restart on the same state dir
    ran = _steps_taken(trainer)
    _run_in_threads([lambda: _step(trainer, "s:train:0", 4), lambda: _fb_of(trainer, "s:train:0", 3)])
    assert ran == [("fb", 3), ("optim_step", 4)]



@pytest.mark.parametrize("how", ["made here", "loaded from a checkpoint", "after a restart"])
def test_a_models_first_steps_run_in_order_whichever_arrives_first(tiny_model_dir, tmp_path, how):
    """A gateway sends a model's optim_step while its forward_backward runs (gateway/futures/
    order.py), so the first two steps may arrive optim_step first. The model's creation starts
    its order at seq_id 1, whether made, loaded from a checkpoint, or on disk from before a restart
    with no step taken yet (durable.py's last_seq is written at the creation): 2 waits for 1. (A
    loaded model's order used to start at the first seq_id it saw, and so did a restarted one
    whose model had taken no step: 2 ran first, and 1's gradients waited for the next step.)"""
    trainer = _trainer(tiny_model_dir, tmp_path)
    model_id = "s:train:1"
    if how == "loaded from a checkpoint":
        _create(trainer, "s:train:0")
        trainer.SaveState(trainer_pb2.SaveStateRequest(model_id="s:train:0", seq_id=1, kind="weights", name="c",
                                                       with_optimizer=True), Context())
        trainer.CreateModel(trainer_pb2.CreateModelRequest(
            model_id=model_id, load_checkpoint=trainer_pb2.CheckpointRef(model_id="s:train:0", kind="weights",
                                                                         name="c"),
            load_optimizer=True), Context())
    else:
        _create(trainer, model_id)
    if how == "after a restart":
        trainer.engine.save_durable(model_id)            # as the idle write leaves a model with no step
        trainer = _trainer(tiny_model_dir, tmp_path)
        assert not trainer.engine.is_resident(model_id) and trainer.engine.on_disk(model_id)
    ran = _steps_taken(trainer)
    _run_in_threads([lambda: _step(trainer, model_id, 2), lambda: _fb_of(trainer, model_id, 1)])
    assert ran == [("fb", 1), ("optim_step", 2)]
    assert trainer.ledger.order.next_of(model_id) == 3


def test_a_resent_create_leaves_the_models_order_as_it_is(tiny_model_dir, tmp_path):
    """A create resent after the model stepped (its reply was lost, gRPC sent it again) returns
    the model as it is, and its order goes on: starting it again at 1 would make the next step
    wait out the gap timeout and count the steps taken as not applied."""
    trainer = _trainer(tiny_model_dir, tmp_path)
    _create(trainer, "s:train:0")
    _fb(trainer, "s:train:0", 1)
    _step(trainer, "s:train:0", 2)
    _create(trainer, "s:train:0")
    assert trainer.ledger.order.next_of("s:train:0") == 3
    assert trainer.ledger.order.wait_turn("s:train:0", 1) is True      # executed: never applied again
    trainer.ledger.order.executed("s:train:0", 1)
    assert trainer.engine.get("s:train:0").step == 1


def test_a_forward_backward_that_does_not_convert_takes_its_turn_not_applied(tiny_model_dir, tmp_path):
    """A datum whose tensor does not decode is refused before any work, its seq_id's turn taken as
    for a step that failed: the next seq_id does not wait out the gap timeout for it, and a good
    copy of it may still run."""
    import grpc
    from servicer_context import Aborted, answered

    trainer = _trainer(tiny_model_dir, tmp_path)
    _create(trainer, "s:train:0")
    ran = _steps_taken(trainer)
    bad = trainer_pb2.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy",
                                             data=[_datum(1)])
    bad.data[0].loss_fn_inputs["weights"].shape[:] = [3]          # 9 values
    context = Context()
    with pytest.raises(Aborted, match=r"datum 0: loss_fn_inputs\['weights'\]: tensor data has 9 elements"):
        answered(trainer.ForwardBackward)(bad, context)
    assert context.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trainer.ledger.order.next_of("s:train:0") == 2
    _fb_of(trainer, "s:train:0", 2)
    _fb_of(trainer, "s:train:0", 1)
    assert ran == [("fb", 2), ("fb", 1)]


def test_a_model_replaced_by_a_load_into_it_goes_on_after_the_loads_seq_id(tiny_model_dir, tmp_path):
    """A load into an existing model (SDK 0.25-0.30's create_training_client_from_state: the
    model is made, then load_weights at seq_id 1 replaces it: DeleteModel, CreateModel from the
    checkpoint) names its seq_id (after_seq_id): the model's next request runs at once. Its order
    used to start at 1 again, and the SDK's next request waited out the 10 s gap timeout for a
    seq_id the load had taken."""
    trainer = _trainer(tiny_model_dir, tmp_path)
    _create(trainer, "s:train:0")
    _fb(trainer, "s:train:0", 1)
    _step(trainer, "s:train:0", 2)
    trainer.SaveState(trainer_pb2.SaveStateRequest(model_id="s:train:0", seq_id=3, kind="weights", name="c",
                                                   with_optimizer=True), Context())
    trainer.DeleteModel(trainer_pb2.DeleteModelRequest(model_id="s:train:0"), Context())
    trainer.CreateModel(trainer_pb2.CreateModelRequest(
        model_id="s:train:0", load_optimizer=True, after_seq_id=4,
        load_checkpoint=trainer_pb2.CheckpointRef(model_id="s:train:0", kind="weights", name="c")), Context())
    assert trainer.ledger.order.next_of("s:train:0") == 5
    t0 = time.monotonic()
    _fb(trainer, "s:train:0", 5)
    assert time.monotonic() - t0 < trainer.ledger.order.gap_timeout_s / 2
    assert trainer.engine.get("s:train:0").step == 1          # the loaded state's
    assert trainer.ledger.durable.next_turn("s:train:0") == 6      # a restart orders after it too


def test_a_gap_a_gateway_waited_out_is_not_waited_out_again():
    """waive(lo, hi): where the trainer's next seq_id is in [lo, hi), a request at hi runs at
    once, the seq_ids between are skipped (not applied: a late copy may run), and a running one
    stops the skip; a waiver that does not reach the trainer's next seq_id changes nothing."""
    order, ran = SeqOrder(gap_timeout_s=30), []
    request = _request_of(order, ran)
    request(1)()
    order.waive("m", 5, 9)                       # next is 2: not this gap
    assert order.next_of("m") == 2
    order.waive("m", 2, 9)
    assert order.next_of("m") == 9
    t0 = time.monotonic()
    request(9)()
    assert ran == [1, 9] and time.monotonic() - t0 < 5
    assert order.wait_turn("m", 4) is False      # skipped, not applied: it may still run
    order.executed("m", 4)
    order.wait_turn("m", 10)                     # running
    order.waive("m", 10, 20)
    assert order.next_of("m") == 10
    order.executed("m", 10)
    assert order.next_of("m") == 11


def test_a_waiver_stops_at_a_seq_id_waiting_here():
    """A seq_id of the waived range that reached the trainer (another gateway's, waiting for the
    gap before it) is not skipped: the waiver stops there, and it runs before the request after it."""
    order, ran = SeqOrder(gap_timeout_s=30), []
    request = _request_of(order, ran)
    request(1)()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        six = pool.submit(request(6))
        deadline = time.monotonic() + 10
        while ("m", 6) not in order._waiting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        order.waive("m", 2, 7)
        six.result(timeout=10)
        assert order.next_of("m") == 7
        request(7)()
    assert ran == [1, 6, 7]
    assert order.wait_turn("m", 4) is False      # skipped, not applied
    order.executed("m", 4)
