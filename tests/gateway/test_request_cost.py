"""What one training request may cost the gateway (issue 24 H2, M2, L4): a body of a few bytes must
not make it allocate gigabytes, the padded batch is capped, and Adam's parameters are bounded."""

import tracemalloc

import numpy as np
import pytest

from gateway import tinker_wire_pb2 as tw
from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture

PROTOBUF = {"content-type": "application/x-protobuf"}


def _request(model_id: str, seq_id: int = 1) -> tw.ForwardBackwardRequest:
    return tw.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")


def _datum(req: tw.ForwardBackwardRequest, tokens: list[int]) -> tw.Datum:
    datum = req.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.shape[:] = tw.DTYPE_INT64, [len(tokens)]
    targets.dense = np.asarray(tokens[1:] + [0], "<i8").tobytes()
    return datum


def _empty_sparse(t: tw.Tensor, shape: list[int]) -> None:
    """A sparse tensor of `shape` with no stored value: a few bytes, shape[0] x shape[1] when dense."""
    t.dtype, t.shape[:] = tw.DTYPE_FLOAT32, shape
    t.sparse_csr.crow_indices = np.zeros(shape[0] + 1, "<i8").tobytes()


def _sparse_bomb(model_id: str) -> bytes:
    """One 1-token datum declaring 16 sparse inputs of shape [1, 2^24]: 1 GiB once dense."""
    req = _request(model_id)
    datum = _datum(req, [5])
    for k in range(16):
        _empty_sparse(datum.loss_fn_inputs[f"w{k}"], [1, 1 << 24])
    return req.SerializeToString()


def _post(gateway, body: bytes, api=None):
    api = api or gateway.api
    return api.client.post("/api/v1/forward_backward", content=body, headers={**PROTOBUF, "X-API-Key": api.api_key})


def _peak_of(fn):
    """(fn's result, the most bytes Python held above the start while it ran: all threads)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak - start


def test_a_tiny_body_declaring_huge_sparse_inputs_is_refused_without_allocating(gateway):
    model_id = gateway.api.model(gateway.api.session())
    body = _sparse_bomb(model_id)
    assert len(body) < 1024
    response, peak = _peak_of(lambda: _post(gateway, body))
    assert_user_error(response, 400, f"more than {gateway.settings.max_body_bytes} bytes in all once dense",
                      "--max-body-bytes")
    assert peak < 4 << 20, f"the gateway allocated {peak} bytes for a {len(body)}-byte body"
    assert gateway.trainer.of("ForwardBackward") == []


def test_the_dense_byte_budget_is_over_all_datums_and_keys(gateway):
    """Each datum alone is small; together they are over the budget."""
    model_id = gateway.api.model(gateway.api.session())
    req = _request(model_id)
    for _ in range(64):
        _empty_sparse(_datum(req, [5]).loss_fn_inputs["weights"], [1, 1 << 18])   # 64 x 2^18 x 4 B = 64 MiB
    gateway.settings.max_body_bytes = 32 << 20
    response, peak = _peak_of(lambda: _post(gateway, req.SerializeToString()))
    assert_user_error(response, 400, "bytes in all once dense")
    assert peak < 4 << 20


def test_every_input_needs_one_row_per_token(gateway):
    model_id = gateway.api.model(gateway.api.session())
    req = _request(model_id)
    _empty_sparse(_datum(req, [5, 6, 7]).loss_fn_inputs["weights"], [4, 2])
    assert_user_error(_post(gateway, req.SerializeToString()), 400, "loss_fn_inputs['weights'] has shape [4, 2]",
                      "expected leading dimension 3")
    req = _request(model_id)
    datum = _datum(req, [5, 6, 7])
    datum.loss_fn_inputs["weights"].dtype = tw.DTYPE_FLOAT32
    datum.loss_fn_inputs["weights"].dense = np.ones(2, "<f4").tobytes()     # no shape: 1-D of 2 values
    assert_user_error(_post(gateway, req.SerializeToString()), 400, "has shape [2], expected leading dimension 3")
    assert gateway.trainer.of("ForwardBackward") == []


def test_another_users_model_is_a_404_before_the_body_is_expanded(gateway):
    model_id = gateway.api.model(gateway.api.session())
    other = gateway.api.as_user("mallory")
    response, peak = _peak_of(lambda: _post(gateway, _sparse_bomb(model_id), api=other))
    assert_user_error(response, 404, "unknown model_id")
    assert peak < 4 << 20


def test_an_ordinary_request_with_weights_and_advantages_passes(gateway):
    """What the SDK sends: target_tokens, weights, logprobs and advantages, one value per token."""
    model_id = gateway.api.model(gateway.api.session())
    req = _request(model_id)
    req.loss_fn = "importance_sampling"
    for tokens in ([5, 6, 7], [8, 9]):
        datum = _datum(req, tokens)
        for key in ("weights", "logprobs", "advantages"):
            t = datum.loss_fn_inputs[key]
            t.dtype, t.shape[:], t.dense = tw.DTYPE_FLOAT32, [len(tokens)], np.ones(len(tokens), "<f4").tobytes()
    response = _post(gateway, req.SerializeToString())
    assert response.status_code == 200, response.json()
    assert gateway.api.result(response.json()).status_code == 200
    (sent,) = gateway.trainer.of("ForwardBackward")
    assert [sorted(d.loss_fn_inputs) for d in sent.data] == [["advantages", "logprobs", "target_tokens",
                                                              "weights"]] * 2


def test_the_padded_batch_is_capped(gateway):
    """One long datum and many one-token ones: the trainer would pad every one to the longest."""
    model_id = gateway.api.model(gateway.api.session())
    gateway.settings.max_batch_tokens = 1000
    req = _request(model_id)
    _datum(req, list(range(1, 101)))
    for _ in range(9):
        _datum(req, [5])
    at_cap = _post(gateway, req.SerializeToString())        # 10 x 100 = 1000: at the cap
    assert at_cap.status_code == 200
    assert gateway.api.result(at_cap.json()).status_code == 200     # run before the trainer is asked
    _datum(req, [5])
    req.seq_id = 2
    assert_user_error(_post(gateway, req.SerializeToString()), 400, "11 datums padded to the longest (100 tokens)",
                      "1100 tokens", "--max-batch-tokens 1000")
    assert [r.seq_id for r in gateway.trainer.of("ForwardBackward")] == [1]


@pytest.mark.parametrize("params, field", [
    ({"learning_rate": 1e6}, "learning_rate"),
    ({"learning_rate": 1.5}, "learning_rate"),
    ({"weight_decay": 10.0}, "weight_decay"),
    ({"eps": 2.0}, "eps"),
])
def test_adam_parameters_are_bounded(gateway, params, field):
    model_id = gateway.api.model(gateway.api.session())
    body = assert_user_error(gateway.api.post("optim_step", {"model_id": model_id, "seq_id": 1,
                                                             "adam_params": params}), 400, field)
    assert "less than or equal to" in body["error"]
    assert gateway.trainer.of("OptimStep") == []


def _int64_sparse_body(model_id: str, width: int) -> bytes:
    """The review's body: 16 one-token datums, each with an empty sparse int64 input [1, width]."""
    req = tw.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    for _ in range(16):
        datum = _datum(req, [5])
        t = datum.loss_fn_inputs["weights"]
        t.dtype, t.shape[:] = tw.DTYPE_INT64, [1, width]
        t.sparse_csr.crow_indices = np.zeros(2, "<i8").tobytes()
    return req.SerializeToString()


def test_int64_counts_eight_bytes_a_value(gateway):
    """Measured before: a 230-byte zstd body of 16 x [1, 524284] int64 passed the element budget
    and stored a 64 MiB futures row. Counted in bytes, it is over the budget."""
    model_id = gateway.api.model(gateway.api.session())
    body = _int64_sparse_body(model_id, 524284)
    assert len(body) < 2048
    response, peak = _peak_of(lambda: _post(gateway, body))
    assert_user_error(response, 400, "bytes in all once dense")
    assert peak < 4 << 20


def test_a_sparse_input_is_stored_and_queued_as_sent(gateway):
    """Under the budget, a sparse input stays sparse up to the trainer: the future's row holds the
    few bytes that came, not 25 MiB of zeros; the trainer gets it sparse and makes it dense; and
    a finished future's stored request is dropped."""
    from gateway.storage.db import FutureRow
    from tinkerd.tensors import to_numpy

    api = gateway.api
    model_id = api.model(api.session())
    app_db = api.client.app.state.gateway.db
    body = _int64_sparse_body(model_id, 200_000)      # 16 x 200,000 x 8 B = 25.6 MB once dense
    response = _post(gateway, body)
    assert response.status_code == 200, response.text
    request_id = response.json()["request_id"]
    assert api.result({"request_id": request_id}).status_code == 200
    message = gateway.trainer.of("ForwardBackward")[-1]       # what the future's row stored, too
    assert message.ByteSize() < 8 << 10, message.ByteSize()
    sent = message.data[0].loss_fn_inputs["weights"]
    assert sent.HasField("sparse_csr") and to_numpy(sent).shape == (1, 200_000) and not to_numpy(sent).any()
    with app_db.engine.connect() as conn:
        from sqlalchemy import select
        row = conn.execute(select(FutureRow.__table__.c.request_body, FutureRow.__table__.c.request_args).where(
            FutureRow.__table__.c.request_id == request_id)).one()
    assert row == (None, None)


def test_queued_training_requests_are_capped_in_bytes(gateway):
    """Requests waiting for their turn (seq_id 1 never came) are held in memory and stored: a
    user's queue is capped in bytes too, not only in requests (429, as for a full queue)."""
    gateway.settings.max_queued_mib_per_user = 1
    model_id = gateway.api.model(gateway.api.session())

    def body(seq_id: int) -> bytes:
        req = _request(model_id, seq_id)
        weights = _datum(req, [5]).loss_fn_inputs["weights"]
        weights.dtype, weights.shape[:] = tw.DTYPE_FLOAT32, [1, 150_000]       # 600 KB, dense
        weights.dense = np.ones(150_000, "<f4").tobytes()
        return req.SerializeToString()
    assert _post(gateway, body(2)).status_code == 200
    response = _post(gateway, body(3))
    assert response.status_code == 429 and "--max-queued-mib-per-user" in response.json()["error"], response.text
    assert response.headers["retry-after"]
