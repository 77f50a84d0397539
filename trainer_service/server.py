"""`tinkerd trainer`: the Trainer gRPC service in its own process."""

from __future__ import annotations

import argparse

from tinkerd.process import cpu_defaults, init_logging, serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model", required=True, help="local directory of the HF base model")
    p.add_argument("--alias", action="append", default=[], help="another name clients may use for the base model")
    p.add_argument("--listen", default="127.0.0.1:0", help="gRPC address (port 0 picks a free one)")
    p.add_argument("--advertise-host", default="127.0.0.1",
                   help="host samplers connect to for weight streaming")
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="base model weights dtype (LoRA weights are float32)")
    p.add_argument("--max-lora-rank", type=int, default=64)


def main(args: argparse.Namespace) -> None:
    cpu_defaults()
    init_logging("trainer")
    from tinkerd.rpc import create_server
    from tinkerd.v1 import trainer_pb2_grpc
    from trainer_service.engine import TrainerEngine
    from trainer_service.servicer import TrainerServicer

    engine = TrainerEngine(args.base_model, zero_stage=args.zero_stage, dtype=args.dtype,
                           max_lora_rank=args.max_lora_rank, base_model_names=tuple(args.alias))
    # Handler threads wait in the fair scheduler, one per model with work in flight.
    server, port = create_server(args.listen, max_workers=256)
    trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(engine, advertise_host=args.advertise_host), server)
    serve_until_signal(server, port, "trainer")
