"""`tinkerd sampler`: the Sampler gRPC service (one vLLM engine) in its own process."""

from __future__ import annotations

import os

from sampler_service.settings import SamplerSettings
from tinkerd.process import cpu_defaults, init_logging, serve_until_signal, service_dtype


def serve(s: SamplerSettings) -> None:
    cpu_defaults()
    init_logging("sampler")
    from sampler_service.engine import MergedSettings, SamplerEngine
    from sampler_service.servicer import SamplerServicer
    from tinkerd.rpc import ServiceAuth, check_exposure, create_server
    from tinkerd.v1 import sampler_pb2_grpc

    auth = ServiceAuth.of(s)
    check_exposure(s.listen, auth, s.allow_insecure)      # before minutes of engine start
    engine = SamplerEngine(s.base_model, dtype=service_dtype(s.dtype, s.allow_slow_dtype),
                           max_model_len=s.max_model_len, max_loras=s.max_loras,
                           max_cpu_loras=s.max_cpu_loras, max_lora_rank=s.max_lora_rank,
                           max_num_seqs=s.max_num_seqs,
                           merged=MergedSettings(s.merged_slots, s.merge_window, s.merge_share,
                                                 s.merge_min_requests))
    # Each Sample call holds a handler thread while vLLM works on it: allow a full batch and more.
    server, port = create_server(s.listen, max_workers=max(256, 2 * s.max_num_seqs), auth=auth,
                                 allow_insecure=s.allow_insecure)
    sampler_pb2_grpc.add_SamplerServicer_to_server(SamplerServicer(engine, state_dir=os.path.abspath(s.state_dir)),
                                                   server)
    serve_until_signal(server, port, "sampler", on_stop=engine.shutdown)
