"""The tokenizer pool (gateway/openai/tokenizer_work.py): a user's jobs beyond its share wait, so another
user's job gets a thread at once; a caller that goes away keeps its slot until its thread is done.
And a loaded tokenizer is out of the cyclic collector's walk."""

from __future__ import annotations

import asyncio
import subprocess
import sys
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



# In a process of its own: gc.freeze() is process-wide.
_AFTER_LOAD = """
import gc, json, sys
from gateway.openai.tokenizer_work import load
tok = load(sys.argv[1])
import transformers
walked = {id(o) for o in gc.get_objects()}
print(json.dumps({"walked": len(walked), "frozen": gc.get_freeze_count(),
                  "tokenizer_walked": id(vars(tok)) in walked, "transformers_walked": id(vars(transformers)) in walked}))
"""


def test_a_loaded_tokenizer_is_not_walked_by_full_collections(tiny_model_dir):
    """Each full collection walked transformers and the tokenizer (~320k objects in the gateway):
    75-250 ms holding the GIL, which every request then waited for (gateway/openai/tokenizer_work.py
    `load`, tinkerd/process.py `freeze_heap`)."""
    import json

    out = subprocess.run([sys.executable, "-c", _AFTER_LOAD, tiny_model_dir], capture_output=True, text=True,
                         check=True, timeout=120)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert not seen["tokenizer_walked"] and not seen["transformers_walked"], seen
    assert seen["frozen"] > 10 * seen["walked"], seen


def test_a_users_waiting_jobs_are_bounded():
    """Requests waiting for a user's share hold their bodies and connections: beyond the bound a
    job is refused with OverLimit (a 429), and the user's and others' jobs go on."""
    from gateway.errors import OverLimit

    async def main():
        pool = TokenizerPool(threads=2, per_user=1, waiting_per_user=3)
        release = threading.Event()
        held = [asyncio.create_task(pool.run("a", release.wait, 10)) for _ in range(4)]
        await asyncio.sleep(0.2)
        try:
            await pool.run("a", lambda: "fifth")
            raise AssertionError("a fifth job of a was let wait")
        except OverLimit as e:
            assert "4 of your tokenizing jobs" in str(e) and "limit 4" in str(e) and e.retry_after_s == 1
        assert await asyncio.wait_for(pool.run("b", lambda: "b"), 2) == "b"
        release.set()
        assert await asyncio.gather(*held) == [True] * 4
        assert await pool.run("a", lambda: "again") == "again"
        assert pool.busy_users() == 0
    asyncio.run(main())
