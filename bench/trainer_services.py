"""The trainer and the gateway as services, without a sampler: SDK steps on a host without vLLM.

`tinkerd up` always starts a sampler, and a GPU host without vLLM's CUDA build (the lent GPU
machines) cannot run one. A training step never touches the sampler, so this starts the two
services a step does cross, `tinkerd trainer` and `tinkerd gateway`, wired as `up` wires them
(as tests/e2e/test_scale_out.py does, through the same harness.services), and hands back the gateway's URL for the
unmodified SDK. bench/trainer_only.py's --sdk rows run through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from typing import Iterator

from bench.host_cores import Split
from harness.services import Service

READY_WITHIN_S = 600.0          # a 1B model's first load on a fresh host


@dataclasses.dataclass
class Running:
    url: str                        # the gateway's, for the SDK
    pids: dict[str, int]            # "trainer", "gateway"


@contextlib.contextmanager
def trainer_and_gateway(model_dir: str, dtype: str, *trainer_flags: str,
                        split: Split | None = None) -> Iterator[Running]:
    """`tinkerd trainer` + `tinkerd gateway` on `model_dir` (auth off, a fresh state dir) while
    they run; both stopped after. With `split`, the trainer runs on its compute cores, with a
    thread each, and the gateway on its host cores."""
    from launcher.up import free_port, service_token_file

    with tempfile.TemporaryDirectory(prefix="trainer-services-") as work:
        state, logs = os.path.join(work, "state"), os.path.join(work, "logs")
        os.makedirs(state, mode=0o700)
        os.makedirs(logs)
        # This process may hold a torch.distributed group of its own (the in-process engines).
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0")
        trainer_env = env if split is None else {**env, "TINKERD_CPU_THREADS": str(len(split.compute))}
        on = (lambda side, argv: argv) if split is None else split.command
        tinkerd = [sys.executable, "-m", "launcher.cli"]
        common = ["--base-model", model_dir, "--state-dir", state, "--service-token-file", service_token_file(state)]
        services: list[Service] = []
        try:
            trainer = Service("trainer", on("compute", [
                *tinkerd, "trainer", *common, "--dtype", dtype, "--allow-slow-dtype", "--listen", "127.0.0.1:0",
                "--durable-idle-s", "0", *trainer_flags]), logs, trainer_env)
            services.append(trainer)
            trainer_port = trainer.ready(READY_WITHIN_S)
            port = free_port()
            services.append(gateway := Service("gateway", on("host", [
                *tinkerd, "gateway", *common, "--trainer", f"127.0.0.1:{trainer_port}", "--port", str(port),
                "--internal-port", str(free_port()), "--no-auth"]), logs, env))
            gateway.ready(READY_WITHIN_S)
            yield Running(f"http://127.0.0.1:{port}", {"trainer": trainer.proc.pid, "gateway": gateway.proc.pid})
        finally:
            for service in reversed(services):
                service.stop()
