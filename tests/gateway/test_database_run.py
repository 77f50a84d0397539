"""Database.run, the one way the gateway's event loop hands work to the database's threads: the
answer or the error comes back to the awaiting caller, the caller's context variables reach the
work, and a caller cancelled before its work started cancels it (run_in_executor's behaviour,
which run replaced with one call_soon_threadsafe per answer)."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import threading
import weakref

import pytest

from gateway.storage.db import Database

TENANT = contextvars.ContextVar("tenant", default=None)


def test_the_answer_the_error_and_the_context_reach_the_caller(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/t.db")

    def boom():
        raise LookupError("no such row")

    async def main():
        TENANT.set("alice")
        assert await db.run(lambda a, b=0: a + b, 2, b=3) == 5
        assert await db.run(TENANT.get) == "alice"
        with pytest.raises(LookupError, match="no such row"):
            await db.run(boom)
        assert threading.current_thread() is threading.main_thread()
        assert (await db.run(threading.current_thread)).name.startswith("db")
    asyncio.run(main())


def test_a_failed_call_leaves_nothing_alive_for_the_collector(tmp_path):
    """The error's traceback holds the database thread's frame: its references are dropped, so
    the caller's arguments go as soon as the error does (the gateway freezes its heap, and full
    collections are rare)."""
    db = Database(f"sqlite:///{tmp_path}/t.db")

    class Payload:
        pass

    def refuse(payload):
        raise ValueError("refused")

    async def main():
        payload = Payload()
        gone = weakref.ref(payload)
        with pytest.raises(ValueError):
            await db.run(refuse, payload)
        del payload
        await db.run(int)            # the one database thread (SQLite) is done with the failed call
        return gone
    gc.disable()
    try:
        gone = asyncio.run(main())
        assert gone() is None
    finally:
        gc.enable()


def test_a_caller_cancelled_before_its_work_starts_cancels_the_work(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/t.db")      # SQLite: one database thread
    release, ran = threading.Event(), []

    async def main():
        busy = asyncio.ensure_future(db.run(release.wait, 10))       # holds the one thread
        queued = asyncio.ensure_future(db.run(ran.append, "queued"))
        await asyncio.sleep(0.05)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        release.set()
        assert await busy is True
        assert await db.run(ran.append, "after") is None           # the thread goes on to later work
    asyncio.run(main())
    assert ran == ["after"]
