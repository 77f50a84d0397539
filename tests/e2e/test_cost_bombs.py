"""Small bodies of large cost, against a real stack: each is refused or served within its budget,
never a 5xx, and the gateway's and trainer's memory stay bounded while they come in, many times.

The corpus: sparse int64 declarations (the 2026-12-06 review's N2 body, and one just under the
byte budget sent into a model's queue behind a seq_id gap), zstd bombs on protobuf and JSON
routes, long token lists, a retrieve_futures poll at its id limit."""

from __future__ import annotations

import json

import httpx
import numpy as np
import psutil
import pytest
import zstandard

from gateway import tinker_wire_pb2 as tw

pytestmark = pytest.mark.e2e

ROUNDS = 12
RSS_GROWTH_BUDGET = 400 << 20       # per service, over the whole corpus


def _service(stack, name: str) -> psutil.Process:
    for child in psutil.Process(stack.pid).children(recursive=True):
        if name in child.cmdline()[3:5]:       # python -m launcher.cli <service> ...
            return child
    raise AssertionError(f"no {name} process under the stack")


def _sparse_int64(model_id: str, seq_id: int, width: int) -> bytes:
    req = tw.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    for _ in range(16):
        datum = req.data.add()
        datum.model_input.add().encoded_text.tokens = np.array([5], "<i4").tobytes()
        targets = datum.loss_fn_inputs["target_tokens"]
        targets.dtype, targets.shape[:], targets.dense = tw.DTYPE_INT64, [1], np.array([6], "<i8").tobytes()
        t = datum.loss_fn_inputs["weights"]
        t.dtype, t.shape[:] = tw.DTYPE_INT64, [1, width]
        t.sparse_csr.crow_indices = np.zeros(2, "<i8").tobytes()
    return zstandard.ZstdCompressor(level=19).compress(req.SerializeToString())


def test_small_bodies_of_large_cost_are_bounded(stack, tiny_model_dir):
    import tinker

    tc = tinker.ServiceClient(base_url=stack.url).create_lora_training_client(base_model=tiny_model_dir,
                                                                              rank=4).result()
    headers = {"X-API-Key": stack.api_key}
    zstd_protobuf = {**headers, "content-type": "application/x-protobuf", "content-encoding": "zstd"}
    zstd_json = {**headers, "content-type": "application/json", "content-encoding": "zstd"}
    n2 = _sparse_int64(tc.model_id, 1, 524284)            # 64 MiB once dense: over the byte budget
    assert len(n2) < 1024
    json_bomb = zstandard.ZstdCompressor(level=19).compress(b'{"tags": [' + b"1," * (16 << 20) + b"1]}")
    tokens = json.dumps({"sampling_session_id": "x", "seq_id": 0, "num_samples": 1, "prompt": {
        "chunks": [{"type": "encoded_text", "tokens": [7] * 1_000_000}]}}).encode()
    ids = json.dumps({"target": {"sampling_session_id": "x"}, "timeout": 0,
                      "retrieved_request_ids": ["f" * 32] * 65536}).encode()
    gateway, trainer = _service(stack, "gateway"), _service(stack, "trainer")
    before = {p: p.memory_info().rss for p in (gateway, trainer)}
    statuses = []
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        for i in range(ROUNDS):
            statuses.append(http.post("/api/v1/forward_backward", content=n2, headers=zstd_protobuf).status_code)
            # Under the budget (25.6 MB once dense), queued behind a seq_id gap: held as sent.
            queued = _sparse_int64(tc.model_id, 1000 + i, 200_000)
            statuses.append(http.post("/api/v1/forward_backward", content=queued, headers=zstd_protobuf).status_code)
            statuses.append(http.post("/api/v1/create_session", content=json_bomb, headers=zstd_json).status_code)
            statuses.append(http.post("/api/v1/asample", content=tokens, headers=headers).status_code)
            statuses.append(http.post("/api/v1/retrieve_futures", content=ids, headers=headers).status_code)
    growth = {p.cmdline()[3]: p.memory_info().rss - rss for p, rss in before.items()}
    print(f"statuses {sorted(set(statuses))}; RSS growth over {ROUNDS} rounds (MiB): "
          f"{ {k: round(v / 2**20) for k, v in growth.items()} }")
    assert all(s < 500 for s in statuses), statuses
    assert statuses[0] == 400 and statuses[1] == 200, statuses[:5]      # refused; queued
    assert all(v < RSS_GROWTH_BUDGET for v in growth.values()), growth
