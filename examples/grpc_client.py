"""Drive tinkerd's Trainer and Sampler gRPC services directly, with no gateway: create a LoRA
model, train it a few steps, push its weights to a sampler, and sample from them.

This is what the REST gateway does for the Tinker SDK (gateway/routes/training.py, weights.py,
sampling.py), written with nothing but the generated stubs (tinkerd/v1/*_pb2*.py, made from
proto/tinkerd/v1/ by `python -m harness.codegen`), grpcio and numpy. The reference for every
message is docs/grpc-api.md.

    tinkerd trainer --base-model DIR --state-dir S --service-token-file T     # prints READY trainer PORT
    tinkerd sampler --base-model DIR --state-dir S --service-token-file T     # prints READY sampler PORT
    python examples/grpc_client.py --trainer 127.0.0.1:PORT --sampler 127.0.0.1:PORT \\
        --base-model DIR --service-token-file T

The tokenizer is the base model's (transformers), only to turn the example's text into token ids:
the services speak token ids. The last line printed is a JSON summary (tests/e2e/test_grpc_example.py
reads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import uuid

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinkerd.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

TEXTS = ["the cat sat on a mat and the dog ran to the red ball", "one two three four five six seven"]
# Training batches and weight manifests can exceed gRPC's default 4 MiB message limit.
OPTIONS = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]


def tensor(values, dtype) -> common_pb2.Tensor:
    """A tinkerd.v1.Tensor: raw little-endian bytes, row-major, with its shape and dtype."""
    arr = np.ascontiguousarray(values, dtype=dtype)
    wire = {np.dtype("<i8"): common_pb2.DTYPE_INT64, np.dtype("<f4"): common_pb2.DTYPE_FLOAT32}[arr.dtype]
    return common_pb2.Tensor(dtype=wire, shape=list(arr.shape), data=arr.tobytes())


def to_numpy(t: common_pb2.Tensor) -> np.ndarray:
    dtype = {common_pb2.DTYPE_FLOAT32: "<f4", common_pb2.DTYPE_INT64: "<i8", common_pb2.DTYPE_INT32: "<i4"}[t.dtype]
    return np.frombuffer(t.data, dtype=dtype).reshape(tuple(t.shape))


def next_token_datum(ids: list[int]) -> common_pb2.Datum:
    """Supervised next-token prediction: the model reads ids[:-1] and is scored on ids[1:]. Every
    tensor in loss_fn_inputs has one row per input position."""
    return common_pb2.Datum(tokens=ids[:-1], loss_fn_inputs={
        "target_tokens": tensor(ids[1:], "<i8"),
        "weights": tensor(np.ones(len(ids) - 1), "<f4")})


def serving(channel: grpc.Channel) -> str:
    """grpc.health.v1 Check: needs no token (so Kubernetes probes work); "SERVING" when ready."""
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@dataclasses.dataclass
class Services:
    """The two stubs, and what every call carries."""
    trainer: trainer_pb2_grpc.TrainerStub
    sampler: sampler_pb2_grpc.SamplerStub
    metadata: tuple
    health: dict[str, str]
    seq_id: int = 0

    def next_seq(self) -> int:
        """Each request that changes a model has a seq_id, increasing per model: a resent
        (model_id, seq_id) gets the first reply back instead of running twice, so a call that
        failed with UNAVAILABLE (trainer restarting) can simply be resent."""
        self.seq_id += 1
        return self.seq_id


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", required=True, help="host:port of `tinkerd trainer`")
    parser.add_argument("--sampler", required=True, help="host:port of `tinkerd sampler`")
    parser.add_argument("--base-model", required=True, help="the base model directory both services serve")
    parser.add_argument("--service-token-file", default="", help="the services' shared token, if they have one")
    parser.add_argument("--steps", type=int, default=4)
    return parser.parse_args(argv)


def connect(args: argparse.Namespace) -> Services:
    # Every call carries the service token as `authorization: Bearer <token>` metadata (tinkerd
    # up makes one per state dir: <state-dir>/service-token). Over TLS, use grpc.secure_channel.
    metadata = ()
    if args.service_token_file:
        with open(args.service_token_file) as f:
            metadata = (("authorization", f"Bearer {f.read().strip()}"),)
    trainer_channel = grpc.insecure_channel(args.trainer, options=OPTIONS)
    sampler_channel = grpc.insecure_channel(args.sampler, options=OPTIONS)
    health = {"trainer": serving(trainer_channel), "sampler": serving(sampler_channel)}
    return Services(trainer_pb2_grpc.TrainerStub(trainer_channel), sampler_pb2_grpc.SamplerStub(sampler_channel),
                    metadata, health)


def create_model(services: Services, base_model: str) -> str:
    """A LoRA model. The caller names it; the trainer keys everything by model_id."""
    model_id = f"example-{uuid.uuid4().hex[:8]}"
    info = services.trainer.CreateModel(trainer_pb2.CreateModelRequest(
        model_id=model_id, base_model=base_model,
        lora_config=common_pb2.LoraConfig(rank=8, seed=0, train_attn=True, train_mlp=True)),
        metadata=services.metadata)
    print(f"created {info.model_id}: {info.num_params} trainable parameters")
    return model_id


def train(services: Services, model_id: str, data: list, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        fb = services.trainer.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
            model_id=model_id, seq_id=services.next_seq(), loss_fn="cross_entropy", data=data),
            metadata=services.metadata)
        losses.append(fb.metrics["loss:sum"])        # metrics are "name:reduction"
        services.trainer.OptimStep(trainer_pb2.OptimStepRequest(
            model_id=model_id, seq_id=services.next_seq(),
            adam_params=common_pb2.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-12)),
            metadata=services.metadata)
        print(f"step {step}: loss {losses[-1]:.4f}")
    return losses


def trainer_logprobs(services: Services, model_id: str, datum) -> np.ndarray:
    """The trained model's logprobs of one datum, to compare with the sampler's."""
    forward = services.trainer.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
        model_id=model_id, seq_id=services.next_seq(), loss_fn="cross_entropy", data=[datum], forward_only=True),
        metadata=services.metadata)
    return to_numpy(forward.outputs[0].outputs["logprobs"])


def push(services: Services, model_id: str, sampler_address: str) -> tuple[str, trainer_pb2.PushWeightsResponse]:
    """The adapter to the sampler: the trainer announces a manifest to each sampler
    (Sampler.ReceiveWeights) and moves the tensors by the transport each link chose (shared
    memory on one host, torch.distributed across hosts); the sampler registers an immutable
    snapshot under the caller's snapshot_id. The reply comes once every sampler has committed it.
    (persist=True would also write a PEFT copy below the trainer's state dir, from which samplers
    sharing that directory reload it after a restart.)"""
    snapshot_id = f"{model_id}@{services.seq_id}"
    pushed = services.trainer.PushWeights(trainer_pb2.PushWeightsRequest(
        model_id=model_id, seq_id=services.next_seq(), snapshot_id=snapshot_id, sampler_addresses=[sampler_address]),
        metadata=services.metadata)
    print(f"pushed {pushed.num_tensors} tensors ({pushed.num_bytes} bytes) in "
          f"{1e3 * (pushed.gather_seconds + pushed.stream_seconds):.0f} ms")
    return snapshot_id, pushed


def sample(services: Services, snapshot_id: str, prompt: list[int], tokenizer) -> sampler_pb2.SampleResponse:
    """Two samples from the snapshot (snapshot_id "" is the base model)."""
    params = sampler_pb2.SamplingParams(max_tokens=8, temperature=1.0, top_p=1.0, top_k=-1, seed=7,
                                        stop_mode=sampler_pb2.SamplingParams.STOP_MODE_NONE)
    sampled = services.sampler.Sample(sampler_pb2.SampleRequest(
        request_id=uuid.uuid4().hex, snapshot_id=snapshot_id, prompt_tokens=prompt, num_samples=2,
        params=params), metadata=services.metadata)
    for seq in sampled.sequences:
        print(f"sampled {list(seq.tokens)}: {tokenizer.decode(seq.tokens)!r}")
    return sampled


def prompt_logprobs(services: Services, snapshot_id: str, prompt: list[int]) -> np.ndarray:
    """The sampler's logprob of each prompt token (NaN for the first, dropped here)."""
    reply = services.sampler.Sample(sampler_pb2.SampleRequest(
        request_id=uuid.uuid4().hex, snapshot_id=snapshot_id, prompt_tokens=prompt, num_samples=1,
        params=sampler_pb2.SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0, top_k=-1, seed=0),
        prompt_logprobs=True), metadata=services.metadata)
    return np.array(reply.prompt_logprobs[1:])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    services = connect(args)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    data = [next_token_datum(tokenizer.encode(t)) for t in TEXTS]

    model_id = create_model(services, args.base_model)
    losses = train(services, model_id, data, args.steps)
    trained = trainer_logprobs(services, model_id, data[0])
    snapshot_id, pushed = push(services, model_id, args.sampler)
    prompt = tokenizer.encode(TEXTS[0])
    sampled = sample(services, snapshot_id, prompt, tokenizer)
    # The snapshot is the trained adapter: the sampler's prompt logprobs match the trainer's,
    # and differ from the base model's.
    snapshot_logprobs, base_logprobs = prompt_logprobs(services, snapshot_id, prompt), prompt_logprobs(services, "", prompt)
    services.trainer.DeleteModel(trainer_pb2.DeleteModelRequest(model_id=model_id), metadata=services.metadata)
    summary = {"health": services.health, "model_id": model_id, "losses": losses, "snapshot_id": snapshot_id,
               "pushed_bytes": pushed.num_bytes, "samples": [list(s.tokens) for s in sampled.sequences],
               "trainer_vs_snapshot": float(np.max(np.abs(snapshot_logprobs - trained))),
               "base_vs_snapshot": float(np.max(np.abs(snapshot_logprobs - base_logprobs)))}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
