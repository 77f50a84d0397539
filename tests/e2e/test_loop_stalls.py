"""The event loop only awaits: the worst body of each route, sent in turn to a real stack while
healthz is polled every 20 ms, never makes a healthz answer take over 250 ms. The bodies are the
"small body, large cost" and "large body" cases: a protobuf forward_backward at the body limit,
its zstd form, JSON bodies at the limit, a deep JSON, a long token list, and a zstd bomb."""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest
import zstandard

from gateway import tinker_wire_pb2 as tw

pytestmark = [pytest.mark.e2e, pytest.mark.serial]

HEALTHZ_BUDGET_S = 0.25
MAX_BODY = 32 << 20               # the gateway's default --max-body-bytes


class Healthz:
    """Polls healthz in a thread; `worst` is the slowest answer since the last `reset`."""

    def __init__(self, url: str):
        self.url, self.worst, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                client.get(f"{self.url}/api/v1/healthz")
                self.worst = max(self.worst, time.monotonic() - t0)
                time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join()


def _forward_backward_at_the_limit(model_id: str) -> bytes:
    """128 datums of 1,024 tokens (the default --max-batch-tokens), each with a dense float32
    input of 60 values a token: ~31.5 MB, just under the body limit. The last datum's target is
    outside the vocabulary, so the request is refused after all of it was parsed and decoded."""
    req = tw.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    tokens = np.arange(1024, dtype="<i4") % 50
    for i in range(128):
        datum = req.data.add()
        datum.model_input.add().encoded_text.tokens = tokens.tobytes()
        targets = datum.loss_fn_inputs["target_tokens"]
        targets.dtype, targets.shape[:] = tw.DTYPE_INT64, [1024]
        targets.dense = (np.full(1024, 10**9 if i == 127 else 3, dtype="<i8")).tobytes()
        extra = datum.loss_fn_inputs["extra"]
        extra.dtype, extra.shape[:] = tw.DTYPE_FLOAT32, [1024, 60]
        extra.dense = np.ones(1024 * 60, "<f4").tobytes()
    body = req.SerializeToString()
    assert len(body) < MAX_BODY
    return body


def _json_at_the_limit(key: str) -> bytes:
    """A JSON body just under the limit: many small values (the costliest to parse)."""
    n = (MAX_BODY - 200) // 8
    return ('{"' + key + '": [' + ",".join(["1234567"] * n) + "]}").encode()


def test_no_body_stalls_the_event_loop(stack, tiny_model_dir):
    import tinker

    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4).result()
    headers = {"X-API-Key": stack.api_key}
    protobuf = {**headers, "content-type": "application/x-protobuf"}
    fb = _forward_backward_at_the_limit(tc.model_id)
    zstd = {**protobuf, "content-encoding": "zstd"}
    cases = {
        "forward_backward at the body limit": ("/api/v1/forward_backward", fb, protobuf),
        "forward_backward, zstd": ("/api/v1/forward_backward", zstandard.ZstdCompressor(level=3).compress(fb), zstd),
        "zstd bomb": ("/api/v1/forward_backward", zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20)),
                      zstd),
        "asample, a long prompt": ("/api/v1/asample", json.dumps({
            "sampling_session_id": "x", "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5] * 3_000_000}]}}).encode(), headers),
        "JSON at the limit": ("/api/v1/create_session", _json_at_the_limit("tags"), headers),
        "retrieve_futures, ids at the limit": ("/api/v1/retrieve_futures", _json_at_the_limit("retrieved_request_ids"),
                                               headers),
        "deep JSON": ("/api/v1/optim_step", b"[" * 100_000 + b"]" * 100_000, headers),
        "OpenAI chat, a long message": ("/oai/api/v1/chat/completions", json.dumps({
            "model": tiny_model_dir, "messages": [{"role": "user", "content": "word " * 3_000_000}]}).encode(),
            {"Authorization": f"Bearer {stack.api_key}"}),
    }
    worst = {}
    with httpx.Client(timeout=120) as client, Healthz(stack.url) as healthz:
        time.sleep(0.2)
        for name, (path, body, hdrs) in cases.items():
            healthz.worst = 0.0
            r = client.post(f"{stack.url}{path}", content=body, headers={"content-type": "application/json", **hdrs})
            assert r.status_code < 500, (name, r.status_code, r.text[:300])
            time.sleep(0.1)
            worst[name] = round(healthz.worst, 3)
    print("slowest healthz answer while each body was handled (s):", worst)
    assert max(worst.values()) < HEALTHZ_BUDGET_S, worst
