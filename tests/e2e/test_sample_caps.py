"""A burst of OpenAI completions against a fresh gateway with --max-samples-per-user 4 (measured
before: 5 of 40 admitted at once, and one bare HTTP 500 from the first tokenizer loads racing
each other in the pool threads): at no moment are more than 4 of the user's samples in flight,
every request is answered 200 or 429, never a 5xx."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e

BURST = 40
CAP = 4


def test_a_burst_of_completions_passes_no_sample_cap(tiny_model_dir, tmp_path, start_stack):
    with start_stack(tiny_model_dir, tmp_path / "state", "--max-samples-per-user", str(CAP)) as stack:
        database = os.path.join(stack.state_dir, "tinkerd.db")
        highest, stop = [0], threading.Event()

        def watch():       # the user's samples in flight, as the limit counts them
            conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
            while not stop.is_set():
                (n,) = conn.execute("SELECT count(*) FROM futures WHERE status = 'pending' "
                                    "AND request_type = 'sample'").fetchone()
                highest[0] = max(highest[0], n)
                time.sleep(0.002)
            conn.close()

        async def burst():
            async with httpx.AsyncClient(base_url=f"{stack.url}/oai/api/v1", timeout=120,
                                         headers={"Authorization": f"Bearer {stack.api_key}"}) as client:
                body = {"model": tiny_model_dir, "prompt": "the cat sat on", "max_tokens": 32, "temperature": 1.0}
                return await asyncio.gather(*[client.post("/completions", json=body) for _ in range(BURST)])

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            replies = asyncio.run(burst())
        finally:
            stop.set()
            watcher.join()
        codes = [r.status_code for r in replies]
        assert set(codes) <= {200, 429}, [(r.status_code, r.text[:200]) for r in replies if r.status_code >= 500]
        assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
        assert 1 <= highest[0] <= CAP, highest       # (1: the watcher did see the samples)
        # The cap refuses; so may the user's share of the tokenizer pool (its queue is bounded too).
        refusals = [r.json()["error"]["message"] for r in replies if r.status_code == 429]
        assert any("of your sample requests are in flight" in m for m in refusals), refusals
        assert all("of your sample requests are in flight" in m or "of your tokenizing jobs" in m
                   for m in refusals), refusals
