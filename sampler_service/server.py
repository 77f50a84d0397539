"""`tinkerd sampler`: the Sampler gRPC service (one vLLM engine) in its own process."""

from __future__ import annotations

import logging
import os
import signal

from sampler_service.settings import SamplerSettings
from tinkerd.process import allocator, cpu_defaults, init_logging, serve_until_signal, service_dtype


def serve(s: SamplerSettings) -> None:
    # tcmalloc: launcher/cli.py re-executes `tinkerd sampler` with it before its imports.
    threads = cpu_defaults()
    init_logging("sampler")
    logging.getLogger("sampler").info("memory allocator: %s", allocator())
    from sampler_service import metrics
    from sampler_service.registration import Registration, advertised_address, check_advertised, check_urls
    from sampler_service.servicer import SamplerServicer
    from tinkerd.health import ServiceHealth
    from tinkerd.metrics import serve as serve_metrics
    from tinkerd.rpc import ServiceAuth, check_exposure, create_server
    from tinkerd.v1 import sampler_pb2_grpc

    auth = ServiceAuth.of(s, role="sampler")
    check_exposure(s.listen, auth, s.allow_insecure)      # before minutes of engine start
    check_urls(s.register_with, auth.tls or bool(s.register_ca))
    check_advertised(advertised_address(s.listen, 0, s.advertise_address), s.register_with)
    check_flags_or_exit(s)
    from tinkerd import cores, hardware
    cores.configure(threads, cpu=not hardware.has_gpu())     # before the engine thread reads it
    serve_metrics(s, s.listen, "sampler")        # its port taken: said now, not after the engine starts
    engine = engine_from(s)
    # Each Sample call holds a handler thread while vLLM works on it: allow a full batch and more.
    server, port = create_server(s.listen, max_workers=max(256, 2 * s.max_num_seqs), auth=auth,
                                 allow_insecure=s.allow_insecure)
    metrics.SNAPSHOTS.set_function(engine.num_snapshots)
    sampler_pb2_grpc.add_SamplerServicer_to_server(SamplerServicer(engine, state_dir=os.path.abspath(s.state_dir)),
                                                   server)
    # Refused by the gateways (a wrong token, an address they cannot reach): stop as on a signal,
    # then exit non-zero with the reason.
    registration = Registration(s.register_with, advertised_address(s.listen, port, s.advertise_address),
                                auth.bearer("gateway"), s.register_ca,
                                on_refused=lambda _: os.kill(os.getpid(), signal.SIGTERM))

    def stop():
        registration.stop()
        engine.shutdown()
    serve_until_signal(server, port, "sampler", on_start=registration.start, on_stop=stop,
                       health=ServiceHealth(server, "tinkerd.v1.Sampler"))
    if registration.refused:
        raise SystemExit(f"tinkerd sampler: {registration.refused}")


def engine_from(s: SamplerSettings):
    """The replica's engine, every engine setting taken from `s`."""
    from sampler_service.engine import MergedSettings, SamplerEngine

    dtype = service_dtype(s.dtype, s.allow_slow_dtype)
    return SamplerEngine(s.base_model, dtype=dtype,
                         max_model_len=s.max_model_len, max_loras=s.max_loras,
                         max_cpu_loras=s.max_cpu_loras, max_lora_rank=s.max_lora_rank,
                         max_num_seqs=s.max_num_seqs, tensor_parallel_size=s.tensor_parallel_size,
                         gpu_memory_utilization=s.gpu_memory_utilization, kv_cache_mib=s.kv_cache_mib,
                         kv_block_tokens=s.kv_block_tokens,
                         merged=MergedSettings(_merged_slots(s, dtype), s.merge_window, s.merge_share,
                                               s.merge_min_requests, s.merge_wait_s))


def check_flags_or_exit(s) -> None:
    """The sampler's flags that vLLM would refuse deep in its start (minutes in, in a log), checked
    first: by `tinkerd sampler`, and by `tinkerd up` before it starts anything. `s`: SamplerSettings,
    or `up`'s parsed flags."""
    if s.max_cpu_loras < s.max_loras:
        raise SystemExit(f"tinkerd sampler: --max-cpu-loras {s.max_cpu_loras} is below --max-loras {s.max_loras}: "
                         f"the snapshots resident in memory must include those active in a batch")
    check_parallelism_or_exit(s.tensor_parallel_size)


def check_parallelism_or_exit(tensor_parallel_size: int) -> None:
    """A tensor-parallel size this machine cannot run ends the process at once, with the reason.
    One rank runs on any machine: that case is answered without importing torch, which would add
    ~2.5 s of CPU to every `tinkerd up` before it starts its children."""
    if tensor_parallel_size == 1:
        return
    import torch

    from sampler_service.engine import check_parallelism
    from tinkerd.errors import UserError

    try:
        check_parallelism(tensor_parallel_size, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    except UserError as e:
        raise SystemExit(f"tinkerd sampler: {e}") from None


def _merged_slots(s: SamplerSettings, dtype: str) -> int:
    """Merged serving runs a second vLLM engine in this process. On a GPU that engine would need
    its own share of GPU memory next to the first one's (not budgeted yet), so it is CPU-only. By
    default it is on in float32 only: merged 16-bit weights W + scale*B@A round away the small
    deltas of a trained adapter, which LoRA serving keeps (docs/benchmarks.md#bf16_gap)."""
    import torch

    if s.merged_slots < 0:
        return 1 if dtype == "float32" else 0
    if s.merged_slots and torch.cuda.is_available():
        logging.getLogger("sampler").warning("merged serving is off on GPU for now (--merged-slots %d ignored): a "
                                             "second engine's GPU memory is not budgeted yet", s.merged_slots)
        return 0
    return s.merged_slots
