"""The trainer's fair scheduler: least-used tenant first, and a bounded memory of idle tenants."""

import threading
import time

from trainer_service import scheduler
from tinkerd.rpc import TENANT_METADATA, user_tenant
from trainer_service.scheduler import FairScheduler, tenant_of


def test_tenant_is_the_user_the_gateway_names_else_the_session():
    named = [("authorization", "Bearer x"), (TENANT_METADATA, user_tenant("u-1"))]
    assert tenant_of("sess-1:train:3", named) == tenant_of("sess-2:train:0", named) == "user:u-1"
    assert tenant_of("sess-1:train:3") == "sess-1" and tenant_of("other", [(TENANT_METADATA, "")]) == "other"


def test_a_waiting_light_tenant_goes_before_a_flooding_one():
    s = FairScheduler()
    order, gate = [], threading.Event()
    s_thread = threading.Thread(target=s.run, args=("flood", gate.wait))   # holds the engine
    s_thread.start()
    time.sleep(0.05)
    threads = [threading.Thread(target=s.run, args=("flood", lambda: (order.append("flood"), time.sleep(0.01))))
               for _ in range(5)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    light = threading.Thread(target=s.run, args=("light", lambda: order.append("light")))
    light.start()
    time.sleep(0.05)
    gate.set()
    for t in [s_thread, light, *threads]:
        t.join(5)
    assert order.index("light") == 0, order


def test_idle_tenants_are_forgotten(monkeypatch):
    monkeypatch.setattr(scheduler, "_KEEP_IDLE", 8)
    s = FairScheduler()
    for i in range(50):
        s.run(f"t{i}", lambda: None)
    assert len(s.snapshot().used_seconds) <= 9


def test_the_servicer_schedules_by_the_tenant_in_the_call_metadata():
    """TrainerServicer._fair reads the gRPC context's metadata (tuples of key, value)."""
    import collections
    import types

    from trainer_service.servicer import TrainerServicer

    Metadatum = collections.namedtuple("Metadatum", ("key", "value"))
    seen = []
    servicer = types.SimpleNamespace(scheduler=types.SimpleNamespace(run=lambda tenant, fn: seen.append(tenant)))
    context = types.SimpleNamespace(invocation_metadata=lambda: (Metadatum(TENANT_METADATA, user_tenant("u-7")),))
    TrainerServicer._fair(servicer, "sess-a:train:0", None, context)
    TrainerServicer._fair(servicer, "sess-b:train:1", None, context)
    TrainerServicer._fair(servicer, "sess-a:train:0", None)          # the trainer's own work
    assert seen == ["user:u-7", "user:u-7", "sess-a"]


def test_before_and_after_are_steps_of_the_works_turn():
    """The ledger's steps around the work (run's `before` and `after`) take the work's turn on the
    engine thread; the work is called by the scheduler's loop itself, with no frame between; a
    `before` that answers means the work does not run."""
    import sys

    s = FairScheduler()
    seen = []

    def work():
        seen.append(("work", threading.current_thread().name, sys._getframe(1).f_code.co_qualname))
        time.sleep(0.01)
        return "result"

    def after(result, seconds):
        seen.append(("after", threading.current_thread().name, result, seconds >= 0.01))
        return "answer"
    before = lambda: seen.append(("before", threading.current_thread().name))  # noqa: E731 - None: go on
    assert s.run("t", work, before=before, after=after) == "answer"
    assert seen == [("before", "fair-scheduler"), ("work", "fair-scheduler", "FairScheduler._loop"),
                    ("after", "fair-scheduler", "result", True)]
    assert s.run("t", work, before=lambda: "kept", after=after) == "kept"
    assert len(seen) == 3
