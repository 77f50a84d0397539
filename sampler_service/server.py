"""`tinkerd sampler`: the Sampler gRPC service (one vLLM engine) in its own process."""

from __future__ import annotations

import argparse

from tinkerd.process import cpu_defaults, init_logging, serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model", required=True, help="local directory of the HF base model")
    p.add_argument("--listen", default="127.0.0.1:0", help="gRPC address (port 0 picks a free one)")
    p.add_argument("--dtype", default="auto", help="vLLM dtype (auto = the checkpoint's)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-loras", type=int, default=4, help="LoRA snapshots active in one batch")
    p.add_argument("--max-cpu-loras", type=int, default=64, help="LoRA snapshots resident")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)


def main(args: argparse.Namespace) -> None:
    cpu_defaults()
    init_logging("sampler")
    from tinkerd.rpc import create_server
    from tinkerd.v1 import sampler_pb2_grpc
    from sampler_service.engine import SamplerEngine
    from sampler_service.servicer import SamplerServicer

    engine = SamplerEngine(args.base_model, dtype=args.dtype, max_model_len=args.max_model_len,
                           max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
                           max_lora_rank=args.max_lora_rank, max_num_seqs=args.max_num_seqs)
    # Each Sample call holds a handler thread while vLLM works on it: allow a full batch and more.
    server, port = create_server(args.listen, max_workers=max(256, 2 * args.max_num_seqs))
    sampler_pb2_grpc.add_SamplerServicer_to_server(SamplerServicer(engine), server)
    serve_until_signal(server, port, "sampler", on_stop=engine.shutdown)
