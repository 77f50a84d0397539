"""The base model's tokenizer, and its work (encoding, chat templates, decoding) run off the event
loop for the OpenAI routes and the console.

A long prompt or 128 long completions with logprobs take seconds of CPU; on the loop that would
stall every tenant (healthz, lease renewals, long-polls). The work runs in a small pool of its
own, not the loop's default executor (the database calls use that one), and one user has at most
`PER_USER` jobs in it at a time, so one tenant cannot take every thread; a user's next job enters
the pool's queue only when one of theirs ends, behind the other users' jobs already queued, so
another user waits for at most one job per thread however many a tenant sends. Beyond `WAITING_PER_USER`
more jobs waiting their turn, a user's request is a 429: the requests waiting hold their bodies
and connections. Threads help only while
the work releases the GIL or runs Python code (which yields every few ms): the Rust encoder holds
the GIL for a whole call, so prompts are also capped in characters before they are encoded
(`prompt_char_cap`).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

from gateway.errors import OverLimit

THREADS = 4
PER_USER = 2
WAITING_PER_USER = 16
# A token is rarely more than a few characters; 8 per token of context leaves room for any real
# prompt that fits, and bounds the encoder's time (it holds the GIL) at a few tens of ms per call.
CHARS_PER_TOKEN = 8


def prompt_char_cap(max_model_len: int) -> int:
    """The most characters of prompt text encoded: longer text cannot fit the context anyway."""
    return CHARS_PER_TOKEN * max_model_len


_LOADING = threading.Lock()


def load(model_dir: str):
    """The tokenizer, loaded once. Under a lock: transformers' lazy module raced itself when
    several pool threads imported it at once (one got ImportError: a bare 500 to its client)."""
    with _LOADING:
        return _load(model_dir)


@functools.lru_cache(maxsize=4)
def _load(model_dir: str):
    from transformers import AutoTokenizer

    from tinkerd.process import freeze_heap
    tok = AutoTokenizer.from_pretrained(model_dir)
    # transformers' modules and the tokenizer's tables: ~320k objects the collector would walk on
    # every full collection. No collect first: that pause would hold up the other requests.
    freeze_heap(collect=False)
    return tok


class TokenizerPool:
    """A bounded pool whose jobs are shared out per user (`run`)."""

    def __init__(self, threads: int = THREADS, per_user: int = PER_USER, waiting_per_user: int = WAITING_PER_USER):
        self.threads, self.per_user, self.waiting_per_user = threads, per_user, waiting_per_user
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._users: dict[str, list] = {}     # user -> [semaphore, jobs holding or waiting for it]

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tokenizer")
            return self._pool

    async def run(self, user: str, fn, *args):
        """`fn(*args)` on a pool thread, after the user's earlier jobs beyond `per_user` finished;
        an OverLimit where `waiting_per_user` more of theirs wait already.
        A caller that goes away (client disconnect) does not free its slot before the thread is
        done: the work still occupies it."""
        entry = self._users.setdefault(user, [asyncio.Semaphore(self.per_user), 0])
        if entry[1] >= self.per_user + self.waiting_per_user:
            raise OverLimit(f"{entry[1]} of your tokenizing jobs (prompts, chat templates, answers) are running or "
                            f"waiting (limit {self.per_user + self.waiting_per_user}); retry when some finish",
                            retry_after_s=1)
        entry[1] += 1
        try:
            await entry[0].acquire()
        except BaseException:
            self._leave(user, entry)
            raise
        try:
            job = asyncio.get_running_loop().run_in_executor(self._executor(), functools.partial(fn, *args))
        except BaseException:
            entry[0].release()
            self._leave(user, entry)
            raise

        def done(_):
            entry[0].release()
            self._leave(user, entry)
        job.add_done_callback(done)
        return await asyncio.shield(job)

    def _leave(self, user: str, entry: list) -> None:
        entry[1] -= 1
        if entry[1] == 0 and self._users.get(user) is entry:
            del self._users[user]

    def busy_users(self) -> int:
        return len(self._users)


pool = TokenizerPool()
