"""A cancelled sample (cancel_future) stops running on the sampler: the gateway cancels its gRPC
call and the sampler aborts the generation in vLLM at once, instead of generating the rest of
its tokens for nobody."""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e


def _aborted(stack) -> list[int]:
    """The sequence count of each generation the sampler has aborted (its log says so)."""
    with open(os.path.join(stack.state_dir, "logs", "sampler.log")) as f:
        return [int(n) for n in re.findall(r"aborted request group \w+ \((\d+) sequences\)", f.read())]


def test_a_cancelled_sample_is_aborted_on_the_sampler(stack, tiny_model_dir):
    headers = {"X-API-Key": stack.api_key}
    service = tinker.ServiceClient(base_url=stack.url)
    sampler = service.create_sampling_client(base_model=tiny_model_dir).result()
    before = len(_aborted(stack))
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 900_001, "num_samples": 8,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 9, 17]}]},
            "sampling_params": {"max_tokens": 1000, "temperature": 1.0, "stop": [], "seed": 1}}
    rid = httpx.post(f"{stack.url}/api/v1/asample", json=body, headers=headers, timeout=60).json()["request_id"]
    time.sleep(1.0)                     # generating by now (8 x 1000 tokens take far longer)
    r = httpx.post(f"{stack.url}/api/v1/cancel_future", json={"request_id": rid}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
    t_cancel = time.monotonic()
    while len(_aborted(stack)) == before and time.monotonic() - t_cancel < 30:
        time.sleep(0.05)
    assert _aborted(stack)[before:] == [8], "the sampler did not abort the cancelled generation"
    aborted_after = time.monotonic() - t_cancel
    assert aborted_after < 5, aborted_after

    # The sampler serves the next sample, with nothing of the cancelled one left in its batch.
    short = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    assert len(sampler.sample(types.ModelInput.from_ints([5, 9, 17]), 1, short).result(timeout=60)
               .sequences[0].tokens) == 4
