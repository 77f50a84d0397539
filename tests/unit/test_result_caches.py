"""Caches of results are bounded in bytes (issue 24 M2): the trainer's reply cache
(trainer_service/replies.py) per model and in all, where the model holding the most gives up its
oldest replies first; the gateway's finished futures in memory (gateway/futures/store.py)."""

import numpy as np
import pytest

from gateway.futures.store import FinishedResults
from gateway.storage.db import FutureRow
from tinkerd.errors import UserError
from tinkerd.tensors import from_numpy
from tinkerd.v1 import trainer_pb2
from trainer_service.replies import ReplyCache


def _reply(tokens: int) -> trainer_pb2.ForwardBackwardResponse:
    return trainer_pb2.ForwardBackwardResponse(outputs=[trainer_pb2.DatumOutput(
        outputs={"logprobs": from_numpy(np.zeros(tokens, np.float32))})])


def test_each_model_keeps_its_latest_replies_within_its_byte_budget():
    cache = ReplyCache(per_model_bytes=10_000, total_bytes=1 << 30)
    for seq in range(1, 6):
        cache.put("m", seq, "forward_backward", _reply(1000))         # ~4 KB each
    kept = [seq for seq in range(1, 6) if cache.get("m", seq, "forward_backward") is not None]
    assert kept == [4, 5] and cache.bytes <= 10_000
    cache.put("m", 6, "forward_backward", _reply(10_000))             # over the budget alone: still kept
    assert cache.get("m", 6, "forward_backward") is not None and cache.get("m", 5, "forward_backward") is None
    with pytest.raises(UserError, match="already used by a forward_backward"):
        cache.get("m", 6, "optim_step")


def test_over_the_total_the_heaviest_model_gives_way_first():
    cache = ReplyCache(per_model_bytes=1 << 30, total_bytes=50_000)
    cache.put("quiet", 1, "forward_backward", _reply(1000))
    for seq in range(1, 20):
        cache.put("busy", seq, "forward_backward", _reply(1000))
    assert cache.bytes <= 50_000
    assert cache.get("quiet", 1, "forward_backward") is not None      # the busy one pushed out its own
    assert cache.get("busy", 1, "forward_backward") is None and cache.get("busy", 19, "forward_backward")
    cache.forget("busy")
    assert cache.bytes < 5_000


def _row(request_id: str, size: int) -> FutureRow:
    return FutureRow(request_id=request_id, status="complete", result=b"x" * size, owner="u")


def test_the_gateways_finished_results_are_bounded_in_bytes_and_rows():
    cache = FinishedResults(max_rows=3, max_bytes=1000)
    for i in range(3):
        cache.put(_row(f"r{i}", 400))
    assert [cache.get(f"r{i}") is not None for i in range(3)] == [False, True, True] and cache.bytes == 800
    cache.put(_row("big", 1001))                      # larger than the budget: read from the database
    assert cache.get("big") is None and cache.bytes == 800
    for i in range(3, 6):
        cache.put(_row(f"r{i}", 1))
    assert len(cache) == 3 and cache.bytes == 3
    cache.pop("r5")
    assert cache.get("r5") is None and cache.bytes == 2
