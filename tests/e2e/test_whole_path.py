"""The whole path through the unmodified tinker SDK: gateway -> gRPC -> DeepSpeed trainer and
vLLM sampler, adapters streamed over torch.distributed."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e

TEXTS = ["the cat sat on a mat and the dog ran to the red ball", "one two three four five",
         "the red ball and the cat"]


@pytest.fixture(scope="module")
def service(stack):
    url = stack.url
    return tinker.ServiceClient(base_url=url)


@pytest.fixture(scope="module")
def base_name(tiny_model_dir):
    return tiny_model_dir


def _data(tok, texts=TEXTS):
    return sft_data(tok, texts)


def test_server_capabilities_list_base_model_and_alias(stack, base_name):
    rc = tinker.RestClient(base_url=stack[0])
    names = [m.model_name for m in rc.get_server_capabilities().result().supported_models]
    assert base_name in names and "tiny/alias-model" in names


def test_sft_loss_falls_and_forward_gives_logprobs(service, base_name):
    tc = service.create_lora_training_client(base_model=base_name, rank=8, seed=0).result()
    assert tc.model_id.endswith(":train:0") or ":train:" in tc.model_id
    tok = tc.get_tokenizer()
    data = _data(tok)
    losses = []
    for _ in range(5):
        fb = tc.forward_backward(data, "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        op.result()
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    out = tc.forward(data, "cross_entropy").result()
    assert len(out.loss_fn_outputs) == len(data)
    for datum, o in zip(data, out.loss_fn_outputs):
        lp = o["logprobs"].to_numpy()
        assert lp.shape == (datum.model_input.length,)
        assert np.all(lp <= 0) and np.all(np.isfinite(lp))
    # The forward pass's loss is the sum of -logprobs (weights are 1).
    total = sum(-o["logprobs"].to_numpy().sum() for o in out.loss_fn_outputs)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4)


def test_snapshot_matches_trainer_and_old_client_keeps_its_weights(service, base_name):
    tc = service.create_lora_training_client(base_model=base_name, rank=8, seed=1).result()
    tok = tc.get_tokenizer()
    data = _data(tok)
    prompt = types.ModelInput.from_ints(tok.encode(TEXTS[0]))
    before = tc.save_weights_and_get_sampling_client().result()
    base_lp = np.array(before.compute_logprobs(prompt).result()[1:])
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trainer_lp = tc.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    after = tc.save_weights_and_get_sampling_client().result()
    sampled_lp = np.array(after.compute_logprobs(prompt).result()[1:])
    assert np.max(np.abs(sampled_lp - trainer_lp)) < 1e-3
    assert np.max(np.abs(sampled_lp - base_lp)) > 1e-2          # training changed the snapshot
    again = np.array(before.compute_logprobs(prompt).result()[1:])
    assert np.max(np.abs(again - base_lp)) < 1e-5               # the old client kept its snapshot


def test_named_sampler_checkpoint_opens_by_path(service, base_name):
    tc = service.create_lora_training_client(base_model=base_name, rank=4, seed=2).result()
    tok = tc.get_tokenizer()
    tc.forward_backward(_data(tok), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_weights_for_sampler("named-1").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/named-1"
    sampler = service.create_sampling_client(model_path=path).result()
    prompt = types.ModelInput.from_ints(tok.encode(TEXTS[1]))
    direct = tc.save_weights_and_get_sampling_client().result()
    a = np.array(sampler.compute_logprobs(prompt).result()[1:])
    b = np.array(direct.compute_logprobs(prompt).result()[1:])
    assert np.max(np.abs(a - b)) < 1e-5


def test_sampling_tokens_logprobs_and_stop_conditions(service, base_name):
    sampler = service.create_sampling_client(base_model=base_name).result()
    tc = service.create_lora_training_client(base_model=base_name, rank=4, seed=3).result()
    tok = tc.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("the cat sat"))

    r = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=8, seed=7, temperature=1.0)).result()
    assert len(r.sequences) == 3
    for s in r.sequences:
        assert 1 <= len(s.tokens) <= 8 and len(s.logprobs) == len(s.tokens)
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.stop_reason in ("length", "stop")

    greedy = types.SamplingParams(max_tokens=10, temperature=0.0, stop=[])   # [] = never stop early
    free = sampler.sample(prompt, 1, greedy).result().sequences[0]
    assert len(free.tokens) == 10 and free.stop_reason == "length"

    stop_token = free.tokens[3]
    cut = free.tokens.index(stop_token)
    by_token = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10, temperature=0.0,
                                                              stop=[stop_token])).result().sequences[0]
    assert by_token.stop_reason == "stop"
    assert by_token.tokens == free.tokens[:cut + 1]

    stop_text = tok.decode([stop_token])
    by_string = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10, temperature=0.0,
                                                               stop=[stop_text])).result().sequences[0]
    assert by_string.stop_reason == "stop"
    assert len(by_string.tokens) <= cut + 1

    with_prompt = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=1),
                                 include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert with_prompt.prompt_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in with_prompt.prompt_logprobs[1:])


def test_bad_input_gets_clear_user_errors_and_service_keeps_working(service, base_name, stack):
    import httpx

    with pytest.raises(tinker.BadRequestError, match="not supported"):
        service.create_lora_training_client(base_model="nobody/unknown-model", rank=4).result()

    tc = service.create_lora_training_client(base_model=base_name, rank=4, seed=4).result()
    tok = tc.get_tokenizer()
    t = tok.encode(TEXTS[0])
    wrong_length = types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                               loss_fn_inputs={"target_tokens": t[1:-2], "weights": [1.0] * (len(t) - 3)})
    with pytest.raises(tinker.BadRequestError, match=f"leading dimension {len(t) - 1}") as e:    # refused at the edge
        tc.forward_backward([wrong_length], "cross_entropy").result()
    assert "loss_fn_inputs" in str(e.value) and "the number of input tokens" in str(e.value)

    out_of_vocab = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 10**6]),
                               loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0] * 3})
    with pytest.raises(tinker.BadRequestError, match="vocabulary"):      # refused at the edge
        tc.forward_backward([out_of_vocab], "cross_entropy").result()

    r = httpx.post(f"{stack.url}/api/v1/optim_step", json={"model_id": "nobody:train:9", "seq_id": 1,
                                                           "adam_params": {"learning_rate": 0.1}},
                   headers={"X-API-Key": stack.api_key})
    assert r.status_code == 404 and r.json()["category"] == "user" and "unknown model_id" in r.json()["error"]

    # The same client still trains fine afterwards.
    good = _data(tok)
    loss = tc.forward_backward(good, "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert np.isfinite(loss)


def test_timings_for_the_record(service, base_name, stack, capsys):
    """Not a threshold test: prints start time, a warm step and adapter sync for the notes."""
    tc = service.create_lora_training_client(base_model=base_name, rank=8, seed=5).result()
    data = _data(tc.get_tokenizer())
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result(), op.result()
        times.append(time.perf_counter() - t0)
    syncs = []
    for _ in range(3):
        t0 = time.perf_counter()
        tc.save_weights_and_get_sampling_client().result().compute_logprobs(types.ModelInput.from_ints([1, 2, 3])).result()
        syncs.append(time.perf_counter() - t0)
    with capsys.disabled():
        print(f"\n[timings] tinkerd up: {stack[2]:.1f} s; warm fwd_bwd+optim via SDK: median "
              f"{1e3 * sorted(times[1:])[2]:.0f} ms; save_weights_and_get_sampling_client+compute_logprobs: "
              f"median {1e3 * sorted(syncs)[1]:.0f} ms")
    assert all(t > 0 for t in times)


def test_services_refuse_grpc_calls_without_the_service_token(stack):
    """`tinkerd up` authenticates the gRPC calls between its services with a token of its own."""
    import os
    import re

    import grpc

    from tinkerd.rpc import ServiceAuth, channel
    from tinkerd.v1 import common_pb2, sampler_pb2_grpc, trainer_pb2_grpc

    token = open(os.path.join(stack.state_dir, "service-token")).read()
    for name, stub_class in (("trainer", trainer_pb2_grpc.TrainerStub), ("sampler", sampler_pb2_grpc.SamplerStub)):
        log = open(os.path.join(stack.state_dir, "logs", f"{name}.log")).read()
        port = re.findall(rf"READY {name} (\d+)", log)[-1]
        address = f"127.0.0.1:{port}"
        with pytest.raises(grpc.RpcError) as e:
            stub_class(channel(address)).Health(common_pb2.HealthRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub_class(channel(address, ServiceAuth(token=token))).Health(common_pb2.HealthRequest(), timeout=10).ready


@pytest.mark.tcmalloc
def test_trainer_and_sampler_run_with_tcmalloc(stack):
    """`tinkerd up`'s trainer and sampler re-executed themselves with tcmalloc preloaded
    (tinkerd/process.py)."""
    from harness.stack import service_pids
    from tinkerd.process import allocator

    pids = service_pids(stack.pid)
    for service in ("trainer", "sampler"):
        pid = pids[service]
        assert allocator(pid) == "tcmalloc", service
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"LD_PRELOAD=libtcmalloc" in f.read(), service


def test_the_gateway_runs_on_uvloop(stack):
    """`tinkerd up`'s gateway runs its event loop on uvloop (gateway/server.py event_loop), as its
    /metrics says from inside the loop."""
    import httpx

    text = httpx.get(f"{stack.internal_url}/metrics", headers={"X-API-Key": stack.api_key}, timeout=10).text
    loops = re.findall(r'^tinkerd_gateway_event_loop_info\{loop="([^"]+)"\} 1\.0$', text, re.M)
    assert loops == ["uvloop"], loops
