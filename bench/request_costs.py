"""The stack's fixed cost per request, by kind, on the tiny model (where the engines take little and
our own work shows, as on a GPU): the CPU the gateway, the trainer's process and the SDK's client
spend per request, and its wall time through the SDK, for forward_backward, optim_step, a
one-token sample, and save_weights_for_sampler (each request waited for before the next: the
fixed cost, not throughput). The floor of a request's round trip is named beside it: one gRPC
unary call to the trainer (its Health) from this process.
"""

from __future__ import annotations

import os
import re
import time

import psutil

from bench.common import Context, Row, tinkerd_up

TARGET_MS = {"sample": 1.0}          # gateway CPU per request; training requests 2 ms (issue: fixed costs)


def _process(stack, service: str) -> psutil.Process:
    for child in psutil.Process(stack.pid).children(recursive=True):
        cmdline = child.cmdline()
        if len(cmdline) > 3 and cmdline[3] == service:       # python -m launcher.cli <service>
            return child
    raise RuntimeError(f"no {service} process under the stack")


def _cpu(process: psutil.Process) -> float:
    t = process.cpu_times()
    return t.user + t.system


def _measure(fn, n: int, processes: dict[str, psutil.Process]) -> dict[str, float]:
    """Per request, in ms: each process's CPU, and the wall time."""
    fn()                                     # warm
    before = {name: _cpu(p) for name, p in processes.items()}
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    wall = time.perf_counter() - t0
    out = {name: 1e3 * (_cpu(p) - before[name]) / n for name, p in processes.items()}
    out["wall"] = 1e3 * wall / n
    return out


def _grpc_floor(stack, n: int) -> float:
    """ms of one trainer Health call over gRPC from this process: a unary round trip's floor."""
    from tinkerd.rpc import ServiceAuth, channel
    from tinkerd.v1 import common_pb2, trainer_pb2_grpc

    with open(os.path.join(stack.state_dir, "service-token")) as f:
        auth = ServiceAuth(token=f.read().strip())
    with open(f"{stack.state_dir}/logs/trainer.log", "rb") as f:
        port = int(re.search(rb"READY trainer (\d+)", f.read()).group(1))
    stub = trainer_pb2_grpc.TrainerStub(channel(f"127.0.0.1:{port}", auth))
    stub.Health(common_pb2.HealthRequest())
    t0 = time.perf_counter()
    for _ in range(n):
        stub.Health(common_pb2.HealthRequest())
    return 1e3 * (time.perf_counter() - t0) / n


def run(ctx: Context) -> list[Row]:
    import tinker
    from tinker import types

    n = ctx.iters(60, 3)
    with tinkerd_up(ctx, "request_costs", ctx.models["tiny"]) as stack:
        processes = {"gateway": _process(stack, "gateway"), "trainer": _process(stack, "trainer"),
                     "client": psutil.Process()}
        service = tinker.ServiceClient(base_url=stack.url)
        tc = service.create_lora_training_client(base_model=ctx.models["tiny"], rank=8).result()
        data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 69))),
                            loss_fn_inputs={"target_tokens": list(range(6, 70)), "weights": [1.0] * 64})
                for _ in range(4)]
        sampler = tc.save_weights_and_get_sampling_client().result()
        one_token = types.SamplingParams(max_tokens=1, temperature=0.0)
        kinds = {
            "forward_backward (4 x 64 tokens)": lambda: tc.forward_backward(data, "cross_entropy").result(),
            "optim_step": lambda: tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(),
            "sample (1 token)": lambda: sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, one_token).result(),
            "save_weights_for_sampler": lambda: tc.save_weights_for_sampler(f"c{time.monotonic_ns()}").result(),
        }
        measured = {kind: _measure(fn, n if "save" not in kind else max(2, n // 10), processes)
                    for kind, fn in kinds.items()}
        floor = _grpc_floor(stack, ctx.iters(500, 5))
    rows = []
    for kind, m in measured.items():
        target = TARGET_MS["sample"] if kind.startswith("sample") else 2.0
        note = (f"trainer process {m['trainer']:.2f} ms CPU, SDK client {m['client']:.2f} ms CPU, "
                f"wall {m['wall']:.2f} ms; gRPC unary floor {floor:.2f} ms")
        rows.append(Row("request_costs", f"{kind}: gateway CPU per request", m["gateway"], None, "ms",
                        target=f"<= {target:g}", met=m["gateway"] <= target, note=note))
    return rows
