"""The tokenizer pool (gateway/openai/tokenizer_work.py): a user's jobs beyond its share wait, so another
user's job gets a thread at once; a caller that goes away keeps its slot until its thread is done."""

from __future__ import annotations

import asyncio
import threading

from gateway.openai.tokenizer_work import TokenizerPool


def test_one_user_cannot_take_every_thread():
    async def main():
        pool = TokenizerPool(threads=3, per_user=2)
        release = threading.Event()
        running = []

        def job(name):
            running.append(name)
            release.wait(10)
            return name

        flood = [asyncio.create_task(pool.run("a", job, f"a{i}")) for i in range(6)]
        await asyncio.sleep(0.2)
        assert sorted(running) == ["a0", "a1"]                  # a's share; a2.. wait
        assert await asyncio.wait_for(pool.run("b", lambda: "b"), 2) == "b"     # the third thread is free for b
        release.set()
        assert await asyncio.gather(*flood) == [f"a{i}" for i in range(6)]
        assert pool.busy_users() == 0
    asyncio.run(main())


def test_a_cancelled_caller_holds_its_slot_until_the_work_ends():
    async def main():
        pool = TokenizerPool(threads=4, per_user=1)
        release = threading.Event()
        started = threading.Event()

        def slow():
            started.set()
            release.wait(10)

        first = asyncio.create_task(pool.run("a", slow))
        await asyncio.to_thread(started.wait, 5)
        first.cancel()                                      # the client went away; the thread still works
        second = asyncio.create_task(pool.run("a", lambda: "second"))
        await asyncio.sleep(0.2)
        assert not second.done()
        release.set()
        assert await asyncio.wait_for(second, 5) == "second"
    asyncio.run(main())

