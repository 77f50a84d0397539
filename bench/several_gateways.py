"""What a request pays for landing on another gateway than the one that runs it: two gateways on
one database behind a round-robin balancer that sends each request to the next gateway (as an
HTTP/1.1 load balancer does), against the same SDK calls sent to one gateway directly, in turn,
round after round, on one trainer and one sampler replica (the tiny model).

    python -m bench.several_gateways [--rounds 4] [--seconds 3] [--postgres]

Behind the balancer half the SDK's polls and fetches reach the gateway not running their future:
it learns of the finish from the other's message (gateway/futures/peers.py: a datagram on SQLite,
a NOTIFY on PostgreSQL), or without one, from its next look at the rows. Per kind, the wall time
of a call through the balancer over direct, per round: its median and range. The balancer (a
Python process, harness/balancer.py) adds its own hop to every request; its cost alone is the
`get_server_capabilities` row (no future).

Not in `python -m bench`: it starts its own five processes (~30 s), where the smoke run shares
one stack.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

KINDS = ("capabilities", "step", "sample", "burst")
BURST = 16


def _start(stack: contextlib.ExitStack, tmp: str, postgres: bool) -> tuple[str, str, str]:
    """Trainer, replica, two gateways and the balancer: (the model, gateway 1's URL, the balancer's)."""
    from bench.common import tiny_model
    from harness.services import Service
    from launcher.up import free_port, service_token_file

    model = tiny_model(os.path.join(tmp, "work"))
    state, logs = os.path.join(tmp, "state"), os.path.join(tmp, "logs")
    os.makedirs(state, mode=0o700)
    os.makedirs(logs)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0")
    tinkerd = [sys.executable, "-m", "launcher.cli"]
    common = ["--base-model", model, "--state-dir", state, "--service-token-file", service_token_file(state)]
    trainer_port, ports, internal = free_port(), [free_port(), free_port()], [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    services: list[Service] = []
    stack.callback(lambda: [s.kill() for s in services])
    services.append(Service("trainer", [*tinkerd, "trainer", *common, "--listen", f"127.0.0.1:{trainer_port}",
                                        "--durable-idle-s", "0"], logs, env))
    services.append(replica := Service("replica", [*tinkerd, "sampler", *common, "--merged-slots", "0", *[
        a for p in internal for a in ("--register-with", f"http://127.0.0.1:{p}")]], logs, env))
    database = []
    if postgres:
        from harness.postgres import postgres as postgres_server
        database = ["--db-url", stack.enter_context(postgres_server(os.path.join(tmp, "pg"), "tinkerd"))]
    gateways = []
    for i, (port, inside) in enumerate(zip(ports, internal)):
        gateways.append(Service(f"gateway-{i + 1}", [
            *tinkerd, "gateway", *common, "--trainer", f"127.0.0.1:{trainer_port}", "--port", str(port),
            "--internal-port", str(inside), *database, "--no-auth"], logs, env))
        services.append(gateways[-1])
        gateways[-1].ready()            # one at a time: the first makes the database's schema
    services.append(balancer := Service("balancer", [sys.executable, "-m", "harness.balancer", "--mode", "request",
                                                     *urls], logs, env))
    for s in services:
        s.ready()
    address = f"127.0.0.1:{replica.ready()}"
    while not all(f"sampler replica {address} is up" in g.text() for g in gateways):
        time.sleep(0.1)
    return model, urls[0], f"http://127.0.0.1:{balancer.ready()}"


def _calls(url: str, model: str) -> dict:
    """{kind: (a call through `url`, the requests it makes of that kind)}."""
    import tinker
    from tinker import types

    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 69))),
                        loss_fn_inputs={"target_tokens": list(range(6, 70)), "weights": [1.0] * 64})
            for _ in range(4)]
    one, prompt = types.SamplingParams(max_tokens=1, temperature=0.0), types.ModelInput.from_ints([5, 6, 7])
    service = tinker.ServiceClient(base_url=url, api_key="tml-no-auth")
    tc = service.create_lora_training_client(base_model=model, rank=8)
    sampler = tc.save_weights_and_get_sampling_client()

    def step():
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        fb.result()

    def burst():
        for f in [sampler.sample(prompt, 1, one) for _ in range(BURST)]:
            f.result()
    return {"capabilities": (service.get_server_capabilities, 1), "step": (step, 1),
            "sample": (lambda: sampler.sample(prompt, 1, one).result(), 1), "burst": (burst, BURST)}


def measure(rounds: int, seconds: float, postgres: bool) -> str:
    """The table: each kind's wall time per call, direct and balanced, in turn for `rounds`."""
    with tempfile.TemporaryDirectory(prefix="several-gateways-") as tmp, contextlib.ExitStack() as stack:
        model, direct, balanced = _start(stack, tmp, postgres)
        calls = {"direct": _calls(direct, model), "balanced": _calls(balanced, model)}
        for way in calls:
            for call, _ in calls[way].values():
                for _ in range(5):
                    call()
        wall = {(way, kind): [] for way in calls for kind in KINDS}
        for r in range(rounds):
            for kind in KINDS:
                for way in (("direct", "balanced") if r % 2 == 0 else ("balanced", "direct")):
                    call, per_call = calls[way][kind]
                    n, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < seconds:
                        call()
                        n += per_call
                    wall[way, kind].append(1e3 * (time.perf_counter() - t0) / n)
                    time.sleep(0.3)
    lines = [f"two gateways on one {'PostgreSQL' if postgres else 'SQLite'} database, {rounds} rounds of {seconds:g} s",
             "", "| call | direct (median ms) | balanced per request | balanced / direct, per round: median (range) |",
             "|---|---|---|---|"]
    names = {"capabilities": "get_server_capabilities (no future: the balancer's hop)", "step": "forward_backward + optim_step (4 x 64)",
             "sample": "a lone 1-token sample", "burst": f"a sample of {BURST} at once"}
    for kind in KINDS:
        ratios = [b / d for b, d in zip(wall["balanced", kind], wall["direct", kind])]
        lines.append(f"| {names[kind]} | {statistics.median(wall['direct', kind]):.1f} | "
                     f"{statistics.median(wall['balanced', kind]):.1f} | {statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--postgres", action="store_true", help="the gateways on PostgreSQL (pgserver), not SQLite")
    args = parser.parse_args(argv)
    print(measure(args.rounds, args.seconds, args.postgres), flush=True)


if __name__ == "__main__":
    main()
