"""`tinkerd trainer`: the Trainer gRPC service in its own process, or as W ranks of one job under
a launcher (`torchrun --nproc-per-node W -m launcher.cli trainer ...`, several hosts through
torchrun's usual flags): rank 0 serves gRPC and the others follow its engine calls (ranks.py)."""

from __future__ import annotations

import logging
import os
import socket
import time

from tinkerd.process import allocator, cpu_defaults, init_logging, serve_until_signal, service_dtype
from trainer_service.settings import TrainerSettings

# A stop's budget for writing the models that are behind: `tinkerd up` waits 15 s for a service to
# stop before killing it (launcher/up.py), a Kubernetes trainer pod gets 60 (deploy/k8s).
STOP_WRITE_S = 10.0


def build_engine(s: TrainerSettings, threads: str, durable=None):
    """The engine, built once this process's CPU threads are set (tinkerd/cores.py): the main thread
    that loads the model runs 1 OpenMP thread. With OMP_NUM_THREADS=N in the environment it would
    load with N and keep that pool of workers for good; beside the computing thread's own pool, the
    process then holds more pooled threads than cores, and libgomp makes every parallel op wait for
    its workers to wake, a whole step slower (docs/benchmarks.md#in-the-trainer)."""
    from tinkerd import cores, hardware
    from trainer_service.engine import TrainerEngine

    cores.configure(threads, cpu=not hardware.has_gpu())
    hardware.cap_gpu_memory(s.gpu_memory_fraction)        # before the engine allocates anything
    return TrainerEngine(s.base_model, zero_stage=s.zero_stage, dtype=service_dtype(s.dtype, s.allow_slow_dtype),
                         max_lora_rank=s.max_lora_rank, base_model_names=tuple(s.aliases), durable=durable,
                         max_resident=s.max_resident_models, max_batch_tokens=s.max_batch_tokens,
                         max_logits_mib=s.max_logits_mib, activation_mib=s.activation_mib)


def choose_rank_interface(world: int) -> None:
    """The interface the ranks' gloo groups use (DeepSpeed's on CPU, the command group always), for
    a job of several ranks: GLOO_SOCKET_IFNAME if set, else the one this host reaches MASTER_ADDR
    by (so one rule serves one host and many; NCCL picks its own, NCCL_SOCKET_IFNAME).
    Left to itself gloo binds to the address the hostname resolves to, and to loopback where it
    resolves to nothing; ranks on other hosts then fail to connect ("Connection refused",
    remote=127.0.0.1). An unreachable MASTER_ADDR ends the rank here, saying so."""
    if world == 1 or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    import psutil

    from tinkerd.weight_stream import local_address_to

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        address = local_address_to(master)
    except OSError as e:
        raise SystemExit(f"tinkerd trainer: MASTER_ADDR {master} is not reachable from this host ({e}); give "
                         f"torchrun --master-addr (or --rdzv-endpoint) an address of rank 0's host that this "
                         f"host routes to") from None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            logging.getLogger("trainer").info("ranks' collectives (gloo) on %s (%s): this host's way to MASTER_ADDR "
                                              "%s", name, address, master)
            return


def wait_for_master(world: int, rank: int, timeout_s: float) -> None:
    """A rank other than 0 waits for the job's store (MASTER_ADDR:MASTER_PORT: torchrun's, or rank
    0's when the ranks were started with the variables alone) to accept a connection, at most
    `timeout_s`, and ends saying so: torch's own connect waits 30 minutes, in silence. Under torchrun
    the store answered its rendezvous already, so this passes at once."""
    master, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if world == 1 or rank == 0 or not master or not port.isdigit():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((master, int(port)),
                                     timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            return
        except OSError as e:
            left = deadline - time.monotonic()
            if left > 0:
                time.sleep(min(1.0, left))
                continue
            raise SystemExit(f"tinkerd trainer: nothing answers at MASTER_ADDR:MASTER_PORT {master}:{port}, the "
                             f"job's store, after {timeout_s:g} s ({e}): start rank 0 (the store is its, or "
                             f"torchrun's on its host), or give every rank the address and port rank 0's host "
                             f"listens on (torchrun --master-addr/--master-port; --master-timeout-s waits "
                             f"longer)") from None


def serve(s: TrainerSettings) -> None:
    threads = cpu_defaults()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    init_logging("trainer" if world == 1 else f"trainer[rank {rank}/{world}]")
    choose_rank_interface(world)
    wait_for_master(world, rank, s.master_timeout_s)
    # tcmalloc: launcher/cli.py re-executes `tinkerd trainer` with it before its imports.
    logging.getLogger("trainer").info("memory allocator: %s", allocator())
    from tinkerd import state_lock
    from tinkerd.health import ServiceHealth
    from tinkerd.rpc import ServiceAuth, advertised_host, check_exposure, create_server, is_local_address
    from tinkerd.v1 import trainer_pb2_grpc
    from trainer_service.durable import DurableModels
    from tinkerd.metrics import serve as serve_metrics
    from trainer_service import metrics
    from trainer_service.servicer import TrainerServicer

    auth = ServiceAuth.of(s, role="trainer")
    check_exposure(s.listen, auth, s.allow_insecure)      # before minutes of model loading
    advertise_host = s.advertise_host or advertised_host(s.listen)
    if rank == 0 and not is_local_address(advertise_host):     # samplers would be sent where nothing listens
        given = f"--advertise-host {advertise_host}" if s.advertise_host else \
            f"{advertise_host} (what --listen {s.listen} advertises)"
        raise SystemExit(f"tinkerd trainer: {given} is not an address of this host: give --advertise-host, the "
                         f"address of this host's interface that the sampler hosts reach")
    state_dir = os.path.abspath(s.state_dir)
    if rank == 0:        # the rank that writes the models' state: alone on its state dir
        state_lock.make_state_dir(state_dir)
        state_lock.hold(state_dir, "trainer", f"`tinkerd trainer` (--listen {s.listen})")
        serve_metrics(s, s.listen, "trainer")        # its port taken: said now, not after the model loads
    engine = build_engine(s, threads, DurableModels(state_dir, s.durable_interval_s))
    engine.ranks.watch(s.rank_timeout_s)
    if not engine.ranks.leader:
        engine.ranks.follow(engine)        # until rank 0 stops; losing it exits non-zero
        return
    # Handler threads wait in the fair scheduler, one per model with work in flight.
    server, port = create_server(s.listen, max_workers=256, auth=auth, allow_insecure=s.allow_insecure)
    metrics.RESIDENT_MODELS.set_function(lambda: len(engine.models.ids()))
    servicer = TrainerServicer(engine, state_dir=state_dir, advertise_host=advertise_host,
                               auth=auth, weight_transports=s.weight_transports, durable_idle_s=s.durable_idle_s)
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
    health = ServiceHealth(server, "tinkerd.v1.Trainer")
    engine.ranks.on_broken.append(health.broken)       # a lost rank: NOT_SERVING at once

    def stop() -> None:
        servicer.write_behind(timeout_s=STOP_WRITE_S)   # a clean stop loses no step
        servicer.pusher.finish_copies(timeout_s=30)     # persisted copies still being written
        servicer.pusher.close()                         # no /dev/shm region left behind
        engine.ranks.stop()
    serve_until_signal(server, port, "trainer", on_stop=stop, health=health)
