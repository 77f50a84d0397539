"""The topology users run, each service on a host of its own (harness/hosts.py: network
namespaces on a bridge, each with its own address, hostname and /dev/shm), and the faults a real
network brings, seen from the SDK in the root namespace.

    host "trainer-0"  trainer rank 0 (torchrun) 10.x.y.2:50051 (metrics :9100), MASTER_ADDR
    host "trainer-1"  trainer rank 1 (torchrun)  ZeRO-2 across the two, gloo over the bridge
    host "sampler-1"  tinkerd sampler        10.x.y.4:50052  emulated link: delay and loss
    host "sampler-2"  tinkerd sampler        10.x.y.5:50052
    host "db"         PostgreSQL             10.x.y.6:5432
    host "gateway"    tinkerd gateway        10.x.y.7:8000, internal :8001

Every service listens on its host's address and advertises nothing else (no flag names an
advertised address, nor GLOO_SOCKET_IFNAME: the rules of tinkerd.rpc.advertised_host and
trainer_service.server.choose_rank_interface apply). The state dir is shared (a shared
filesystem, as deployments have); /dev/shm is not, so a weight push can only travel by gloo
over the bridge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from conftest import TINY_KV_CACHE
from harness import hosts
from harness.postgres import postgres_on
from harness.services import Service

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRAINER_PORT, SAMPLER_PORT, GATEWAY_PORT, INTERNAL_PORT, METRICS_PORT = 50051, 50052, 8000, 8001, 9100
MASTER_PORT = 29500
LEASE_S = 2.0
# libpq's own: a connection whose sent data goes unacknowledged for 3 s, or whose peer fails 2
# keepalive probes, fails, instead of waiting out TCP's retransmissions (~15 min) on a silent network.
DB_LINK = "connect_timeout=3&tcp_user_timeout=3000&keepalives=1&keepalives_idle=2&keepalives_interval=1" \
          "&keepalives_count=2"
RANK_TIMEOUT_S = 5.0          # a silent rank breaks the trainer job after this (30 s by default)


@dataclasses.dataclass
class Cluster:
    net: hosts.Network
    hosts: dict[str, hosts.Host]
    services: dict[str, Service]
    db_url: str
    token: str
    gateway_command: list[str]       # less the addresses it listens on
    logs: str
    env: dict

    def start_gateway(self, name: str) -> Service:
        """Another gateway, on a new host `name`, sharing the database, trainer and replicas."""
        host = self.net.add_host(name)
        gateway = host.service(name, [*self.gateway_command, "--host", host.address, "--internal-host",
                                      host.address], self.logs, self.env)
        self.hosts[name], self.services[name] = host, gateway
        gateway.ready()
        return gateway

    def address(self, host: str, port: int) -> str:
        return f"{self.hosts[host].address}:{port}"

    @property
    def url(self) -> str:
        return f"http://{self.address('gateway', GATEWAY_PORT)}"

    def internal(self, path: str):
        request = urllib.request.Request(f"http://{self.address('gateway', INTERNAL_PORT)}{path}",
                                         headers={"authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    def pool(self) -> dict[str, dict]:
        """The gateway's sampler pool, by address."""
        return {s["address"]: s for s in self.internal("/internal/v1/samplers/list")["samplers"]}

    def registered(self) -> list[str]:
        import sqlalchemy

        engine = sqlalchemy.create_engine(self.db_url)
        try:
            with engine.connect() as conn:
                return sorted(conn.execute(sqlalchemy.text("SELECT address FROM sampler_replicas")).scalars())
        finally:
            engine.dispose()

    def trainer_metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.address('trainer-0', METRICS_PORT)}/metrics", timeout=10) as r:
            return r.read().decode()


def _wait_for(predicate, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    reason = hosts.unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    from launcher.up import service_token_file

    root = tmp_path_factory.mktemp("multi-host")
    state, logs = str(root / "state"), str(root / "logs")
    os.makedirs(state, mode=0o700)
    os.makedirs(logs)
    token_file = service_token_file(state)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                              "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0")
    tinkerd = [sys.executable, "-m", "launcher.cli"]
    common = ["--base-model", tiny_model_dir, "--state-dir", state, "--service-token-file", token_file]
    exact = ["--dtype", "float32"]           # trainer = sampler exactly (conftest.py)
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(hosts.Network())
        made = {name: net.add_host(name, emulated=name == "sampler-1")
                for name in ("trainer-0", "trainer-1", "sampler-1", "sampler-2", "db", "gateway")}
        at = {name: h.address for name, h in made.items()}
        services = {}
        for rank, name in enumerate(("trainer", "trainer-rank-1")):
            host = made[f"trainer-{rank}"]
            services[name] = host.service(name, [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(rank), "--master-addr", at["trainer-0"], "--master-port", str(MASTER_PORT),
                "-m", "launcher.cli", "trainer", *common, *exact, "--listen", f"{host.address}:{TRAINER_PORT}",
                "--metrics-port", str(METRICS_PORT), "--rank-timeout-s", str(RANK_TIMEOUT_S),
                "--durable-interval-s", "0"], logs, env)
        for name in ("sampler-1", "sampler-2"):
            services[name] = made[name].service(name, [
                *tinkerd, "sampler", *common, *exact, *TINY_KV_CACHE, "--merged-slots", "0",
                "--listen", f"{at[name]}:{SAMPLER_PORT}",
                "--register-with", f"http://{at['gateway']}:{INTERNAL_PORT}"], logs, env)
        db_url = stack.enter_context(postgres_on(made["db"], root / "pg", "tinkerd"))
        gateway = [*tinkerd, "gateway", *common, "--trainer", f"{at['trainer-0']}:{TRAINER_PORT}",
                   "--port", str(GATEWAY_PORT), "--internal-port", str(INTERNAL_PORT),
                   "--db-url", f"{db_url}?{DB_LINK}",
                   "--no-auth", "--future-lease-s", str(LEASE_S)]
        services["gateway"] = made["gateway"].service("gateway", [
            *gateway, "--host", at["gateway"], "--internal-host", at["gateway"]], logs, env)
        for name, service in services.items():
            if name != "trainer-rank-1":        # a follower serves nothing
                service.ready()
        cluster = Cluster(net, made, services, db_url, open(token_file).read().strip(), gateway, logs, env)
        replicas = [cluster.address(name, SAMPLER_PORT) for name in ("sampler-1", "sampler-2")]
        _wait_for(lambda: all(cluster.pool().get(r, {}).get("alive") for r in replicas),
                  f"the replicas never joined the pool: {cluster.pool()}")
        yield cluster


@pytest.fixture(scope="module")
def service(cluster):
    import tinker

    # The gateway runs --no-auth; the key is passed, not set in os.environ, which later tests read.
    return tinker.ServiceClient(base_url=cluster.url, api_key="tml-no-auth")


def _train_one_step(service, tiny_model_dir, rank: int = 4):
    from tinker import types

    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=rank, seed=3).result()
    tok = tc.get_tokenizer()
    tokens = tok.encode("the cat sat on the mat and looked at the dog")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return tc, datum, tokens


def _logprobs_everywhere(cluster, sc, tokens, n: int = 8) -> list[np.ndarray]:
    """compute_logprobs `n` times at once (the pool spreads them over the replicas)."""
    from tinker import types

    prompt = types.ModelInput.from_ints(tokens)
    futures = [sc.compute_logprobs(prompt) for _ in range(n)]
    return [np.array(f.result()[1:]) for f in futures]


def _pushes(log: str) -> list[tuple[str, str, float]]:
    """The trainer's weight streams: (replica, transport, total ms)."""
    return [(m.group(1), m.group(2), float(m.group(3)))
            for m in re.finditer(r"stream \S+ to (\S+): (\w+), .*\(total ([\d.]+)\)", log)]


def test_the_topology_trains_and_samples_across_hosts(cluster, service, tiny_model_dir):
    tc, datum, tokens = _train_one_step(service, tiny_model_dir)
    trainer_lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    served_before = {a: s["served"] for a, s in cluster.pool().items()}
    sc = tc.save_weights_and_get_sampling_client().result()
    for lp in _logprobs_everywhere(cluster, sc, tokens):
        assert np.max(np.abs(lp - trainer_lp)) < 1e-3
    from tinker import types
    out = sc.sample(types.ModelInput.from_ints(tokens[:4]), 2, types.SamplingParams(max_tokens=8)).result()
    assert len(out.sequences) == 2 and all(len(s.tokens) == 8 for s in out.sequences)

    replicas = sorted(cluster.address(name, SAMPLER_PORT) for name in ("sampler-1", "sampler-2"))
    pool = cluster.pool()
    # Both replicas answered, both were reached by gloo over the bridge (never shared memory).
    assert all(pool[r]["served"] > served_before.get(r, 0) for r in replicas), pool
    assert {pool[r]["weight_transport"] for r in replicas} == {"gloo"}, pool
    trainer_log = cluster.services["trainer"].text()
    for replica, name in zip(replicas, ("sampler-1", "sampler-2")):
        assert re.search(rf"weight transport to {re.escape(replica)}: gloo \(hosts trainer-0 and {name}, cpu",
                         trainer_log), trainer_log[-3000:]
        sampler_log = cluster.services[name].text()
        at = re.escape(cluster.hosts[name].address)
        assert re.search(rf"weight group \S+ with {re.escape(cluster.hosts['trainer-0'].address)}:\d+ formed "
                         rf"\(gloo, this end on {at}\)", sampler_log), sampler_log[-3000:]
        assert re.search(r"snapshot \S+: \d+ tensors in [\d.]+ ms \(gloo join", sampler_log)
    assert re.search(r'tinkerd_trainer_weight_links_total\{transport="gloo"\} [1-9]', cluster.trainer_metrics())
    # The two ranks' collectives run over the bridge, each on the interface it reaches rank 0 by.
    master = cluster.hosts["trainer-0"].address
    for rank, service in enumerate(("trainer", "trainer-rank-1")):
        text = cluster.services[service].text()
        host = re.escape(cluster.hosts[f"trainer-{rank}"].address)
        assert re.search(rf"trainer\[rank {rank}/2\] INFO trainer: ranks' collectives \(gloo\) on eth0 \({host}\): "
                         rf"this host's way to MASTER_ADDR {re.escape(master)}", text), text[-3000:]
    assert "shm" not in {t for _, t, _ in _pushes(trainer_log)}
    # What the replicas registered is what the others reach them at: no loopback leaked.
    assert cluster.registered() == replicas
    assert not [line for line in trainer_log.splitlines() if "127.0.0.1" in line and "stream" in line]


def _new_pushes(cluster, since: int) -> dict[str, float]:
    """The trainer's weight streams logged after `since` characters of its log: replica -> ms."""
    return {replica: ms for replica, _, ms in _pushes(cluster.services["trainer"].text()[since:])}


def test_a_slow_lossy_link_to_one_sampler_host(cluster, service, tiny_model_dir):
    """100 ms more round trip and 1% of the frames lost each way, to sampler-1 only: the weight
    push completes, the samples are right, and the push's time says what the link cost. (Rank
    64: an adapter of ~0.8 MB, so the push alone is hundreds of frames, some of them lost.)"""
    from tinker import types

    slow, fast = (cluster.address(name, SAMPLER_PORT) for name in ("sampler-1", "sampler-2"))
    link = cluster.hosts["sampler-1"]
    log_at = len(cluster.services["trainer"].text())
    tc, datum, tokens = _train_one_step(service, tiny_model_dir, rank=64)
    tc.save_weights_and_get_sampling_client().result()
    before = _new_pushes(cluster, log_at)
    link.shape(delay_ms=50, loss=0.01)
    try:
        counted = link.pump_settings()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()   # the same gradients, another step
        trainer_lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        log_at = len(cluster.services["trainer"].text())
        served = {a: s["served"] for a, s in cluster.pool().items()}
        t0 = time.monotonic()
        sc = tc.save_weights_and_get_sampling_client().result()
        save_s = time.monotonic() - t0
        after = _new_pushes(cluster, log_at)
        t0 = time.monotonic()
        for lp in _logprobs_everywhere(cluster, sc, tokens, n=12):
            assert np.max(np.abs(lp - trainer_lp)) < 1e-3
        logprobs_s = time.monotonic() - t0
        pool = cluster.pool()
        now = link.pump_settings()
    finally:
        link.shape()
    frames, lost = now["forwarded"] - counted["forwarded"], now["dropped"] - counted["dropped"]
    assert set(after) == {slow, fast}, after
    assert pool[slow]["served"] > served[slow], pool        # the slow replica answered some of them
    assert lost > 0, now                                    # frames were lost, and nothing showed it but time
    # The push's gRPC announce, its gloo handshake and the commit each wait a round trip.
    assert after[slow] >= 200 and after[slow] > after[fast], (before, after)
    print(f"weight push, ms: before shaping {before}, shaped {after}; save_weights_and_get_sampling_client "
          f"{save_s:.2f} s; 12 compute_logprobs {logprobs_s:.2f} s; {lost} of {frames + lost} frames lost")


PARTITION_S = 30.0


def test_a_sampler_host_partitioned_mid_sampling(cluster, service, tiny_model_dir):
    """sampler-1 cut off (silently, both ways) for 30 s while samples run on it: they are
    answered by sampler-2, the pool drops sampler-1, a snapshot saved meanwhile reaches only
    sampler-2, and once healed sampler-1 rejoins and serves that newest snapshot."""
    from tinker import types

    lost, kept = (cluster.address(name, SAMPLER_PORT) for name in ("sampler-1", "sampler-2"))
    host = cluster.hosts["sampler-1"]
    tc, datum, tokens = _train_one_step(service, tiny_model_dir)
    sc = tc.save_weights_and_get_sampling_client().result()
    long = types.SamplingParams(max_tokens=512, temperature=1.0, stop=[])
    in_flight = [sc.sample(types.ModelInput.from_ints(tokens[:4]), 1, long) for _ in range(8)]
    _wait_for(lambda: cluster.pool()[lost]["in_flight"] > 0, "no sample reached sampler-1", 60)
    gateway_at = len(cluster.services["gateway"].text())
    host.partition()
    t0, cut = time.monotonic(), time.time()
    try:
        results = [f.result(timeout=120) for f in in_flight]
        answered_s = time.monotonic() - t0
        assert all(len(r.sequences[0].tokens) == long.max_tokens for r in results)
        _wait_for(lambda: lost not in cluster.pool(), "the pool never dropped the partitioned replica", 60)
        dropped_s = time.monotonic() - t0
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        trainer_lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        newest = tc.save_weights_and_get_sampling_client().result()
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - t0)))
    finally:
        host.heal()
    healed = time.monotonic()
    _wait_for(lambda: cluster.pool().get(lost, {}).get("alive"), "sampler-1 never rejoined", 60)
    rejoined_s = time.monotonic() - healed
    # A snapshot saved now is pushed to both again (over the links formed before the cut).
    log_at = len(cluster.services["trainer"].text())
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    newer_lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    newer = tc.save_weights_and_get_sampling_client().result()
    assert set(_new_pushes(cluster, log_at)) == {lost, kept}
    # With sampler-2 cut off from the gateway alone, sampler-1 answers: the snapshot it missed (from
    # its persisted copy) and the one pushed to it since.
    cluster.hosts["sampler-2"].partition(cluster.hosts["gateway"])
    try:
        _wait_for(lambda: not cluster.pool()[kept]["alive"], "the gateway never saw sampler-2 go", 30)
        served = cluster.pool()[lost]["served"]
        for client, expected in ((newest, trainer_lp), (newer, newer_lp)):
            for lp in _logprobs_everywhere(cluster, client, tokens, n=2):
                assert np.max(np.abs(lp - expected)) < 1e-3
        assert cluster.pool()[lost]["served"] == served + 4
    finally:
        cluster.hosts["sampler-2"].heal(cluster.hosts["gateway"])
    gateway_log = cluster.services["gateway"].text()[gateway_at:]
    assert re.search(rf"sampler replica {re.escape(lost)} failed a sample", gateway_log), gateway_log[-3000:]
    redriven = re.search(rf"^(\S+ \S+) gateway WARNING .*{re.escape(lost)} failed \d+ health checks in a row; "
                         rf"re-driving its (\d+) samples", gateway_log, re.M)
    assert redriven, gateway_log[-3000:]
    redriven_s = time.mktime(time.strptime(redriven.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + \
        float("0." + redriven.group(1)[20:]) - cut
    print(f"partitioned sampler host: {redriven.group(2)} of the {len(in_flight)} samples in flight re-driven "
          f"{redriven_s:.1f} s after the cut, all answered after {answered_s:.1f} s; the pool dropped it (seen "
          f"{dropped_s:.1f} s after the cut); it rejoined {rejoined_s:.1f} s after the heal")


def _worker(service: Service):
    """The trainer rank (torchrun's worker) under a torchrun service."""
    import psutil

    return next(p for p in psutil.Process(service.proc.pid).children(recursive=True) if "launcher.cli" in p.cmdline())


def _busy(process, window_s: float = 0.2) -> bool:
    """Whether `process` spent a quarter of the next `window_s` on a CPU (a rank inside a step: an
    idle one spends ~1%; a busy one under a full suite's load may get a third of a core). Short: on
    a fast machine the whole step below takes under a second."""
    before = sum(process.cpu_times()[:2])
    time.sleep(window_s)
    return sum(process.cpu_times()[:2]) - before > window_s / 4


def _pending(future) -> bool:
    """Whether the SDK's future is still waiting (one that failed raises its error here)."""
    try:
        future.result(timeout=0.05)
    except TimeoutError:
        return True
    return False


def test_a_trainer_rank_host_partitioned_mid_step(cluster, service, tiny_model_dir):
    """trainer-1 (rank 1) cut off while both ranks are inside a forward_backward: the job breaks
    within the rank timeout (not the collectives' 30 minutes), rank 0 says NOT_SERVING and both
    ranks exit; restarted after the heal (as a supervisor would), the same TrainingClient gets
    that forward_backward's result and goes on from its last applied step, nothing applied twice
    (the same steps on a client that saw no fault give the same gradient norm and weights)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tinker import types

    tc, datum, tokens = _train_one_step(service, tiny_model_dir)          # step 1, on disk before its reply
    before = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    long = (tokens * 100)[:900]            # a step of ~1 s (AMX) to seconds: 96 such datums, half on each rank
    batch = [types.Datum(model_input=types.ModelInput.from_ints(long[:-1]),
                         loss_fn_inputs={"target_tokens": long[1:], "weights": [1.0] * (len(long) - 1)})
             for _ in range(96)] + [datum]
    trainers = [cluster.services[name] for name in ("trainer", "trainer-rank-1")]
    rank1 = _worker(trainers[1])
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(cluster.address("trainer-0", TRAINER_PORT)))
    statuses = []
    watching = health.Watch(health_pb2.HealthCheckRequest(), metadata=[("authorization", f"Bearer {cluster.token}")],
                            timeout=120)
    assert next(watching).status == health_pb2.HealthCheckResponse.SERVING

    def watch():
        with contextlib.suppress(grpc.RpcError):
            statuses.extend(reply.status for reply in watching)
    threading.Thread(target=watch, daemon=True).start()
    fb = tc.forward_backward(batch, "cross_entropy")
    _wait_for(lambda: _busy(rank1), "rank 1 never started the forward_backward", 60)
    cluster.hosts["trainer-1"].partition()
    cut = time.monotonic()
    try:
        assert _pending(fb)
        _wait_for(lambda: trainers[0].proc.poll() is not None, "rank 0 did not exit", 60)
        exited_s = time.monotonic() - cut
        _wait_for(lambda: trainers[1].proc.poll() is not None, "rank 1 did not exit", 60)
        rank1_s = time.monotonic() - cut
    finally:
        cluster.hosts["trainer-1"].heal()
    logs = [t.text() for t in trainers]
    held = _pending(fb)                    # no error: the gateway holds it for the trainer's return
    t0 = time.monotonic()
    for trainer in trainers:               # the supervisor's part (tinkerd up, systemd, Kubernetes)
        trainer.start()
    trainers[0].ready()
    restarted_s = time.monotonic() - t0
    assert re.search(r"trainer job broken: rank 1 has not checked in for \d+ s", logs[0]), logs[0][-3000:]
    # Rank 1 ends by its watchdog, or by its collective's own error when gloo's read times out first.
    assert re.search(r"rank 1: the job's store at \S+ has not answered|rank 1: forward_backward failed; exiting",
                     logs[1]), logs[1][-3000:]
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, statuses
    assert held
    result = fb.result(timeout=120)
    answered_s = time.monotonic() - t0
    # Run on step 1's weights, once: its last datum's logprobs are the forward's before the cut.
    np.testing.assert_allclose(result.loss_fn_outputs[-1]["logprobs"].to_numpy(), before, atol=1e-4)
    step = tc.optim_step(types.AdamParams(learning_rate=5e-2)).result().metrics

    twin, _, _ = _train_one_step(service, tiny_model_dir)                 # the same seed, no fault
    twin.forward_backward(batch, "cross_entropy").result()
    twin_step = twin.optim_step(types.AdamParams(learning_rate=5e-2)).result().metrics
    assert step["step:max"] == twin_step["step:max"] == 2.0
    assert step["grad_norm:mean"] == pytest.approx(twin_step["grad_norm:mean"], rel=1e-5)   # not doubled
    after = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    twin_after = twin.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(after, twin_after, atol=1e-5)
    print(f"trainer rank host cut mid-step: rank 0 broke and exited {exited_s:.1f} s after the cut, rank 1 "
          f"{rank1_s:.1f} s (--rank-timeout-s {RANK_TIMEOUT_S:.0f}); restarted in {restarted_s:.1f} s; the "
          f"forward_backward answered {answered_s:.1f} s after the restart began")


def health_log(balancer: Service) -> str:
    return "; ".join(line for line in balancer.text().splitlines() if line.startswith("backend "))


def test_the_database_partitioned_from_one_of_two_gateways(cluster, tiny_model_dir):
    """Two gateways on one PostgreSQL behind a balancer that health-checks their /healthz
    (harness/balancer.py). The database host cut off from gateway-2 while the SDK's work is
    in flight through both: gateway-2's /healthz fails on the database, the balancer drops it
    (ending the calls it held there, so the SDK retries them on gateway), gateway re-drives what
    gateway-2 was running once its leases lapse, and every future reaches the SDK, each step
    applied once. Healed, gateway-2 passes its checks and serves again."""
    import httpx
    import tinker
    from tinker import types

    second = cluster.start_gateway("gateway-2")
    urls = [f"http://{cluster.address(name, GATEWAY_PORT)}" for name in ("gateway", "gateway-2")]
    balancer = Service("balancer", [sys.executable, "-m", "harness.balancer", "--mode", "request", "--health-path",
                                    "/api/v1/healthz", "--health-every-s", "0.5", *urls], cluster.logs, cluster.env)
    try:
        balanced = f"http://127.0.0.1:{balancer.ready(30)}"
        health = lambda: httpx.get(balanced + "/_balancer/health", timeout=5).json()      # noqa: E731
        _wait_for(lambda: all(h["up"] for h in health().values()), f"a gateway never passed: {health()}", 30)
        service = tinker.ServiceClient(base_url=balanced, api_key="tml-no-auth")
        tc, datum, tokens = _train_one_step(service, tiny_model_dir)
        sc = tc.save_weights_and_get_sampling_client().result()
        gateway_2_at = len(second.text())
        long = types.SamplingParams(max_tokens=64, temperature=1.0, stop=[])
        samples = [sc.sample(types.ModelInput.from_ints(tokens[:4]), 1, long) for _ in range(4)]
        steps = [(tc.forward_backward([datum], "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=5e-2)))
                 for _ in range(2)]
        _wait_for(lambda: "/api/v1/asample" in httpx.get(balanced + "/_balancer/stats").json()[urls[1]],
                  "no sample went through gateway-2", 30)
        cluster.hosts["db"].partition(cluster.hosts["gateway-2"])
        cut = time.monotonic()
        try:
            _wait_for(lambda: not health()[urls[1]]["up"], "the balancer never dropped gateway-2", 30)
            dropped_s = time.monotonic() - cut
            # Failed: a 503 naming the database, or no answer at all (the gateway's event loop waits on
            # its synchronous database calls, each failing after DB_LINK's timeouts).
            try:
                reply = httpx.get(urls[1] + "/api/v1/healthz", timeout=5)
                assert reply.status_code == 503 and reply.json()["database"] == "unreachable", reply.text
                seen = "503, database unreachable"
            except httpx.TimeoutException:
                seen = "no answer within 5 s"
            assert health()[urls[0]]["up"], health()
            results = [f.result(timeout=120) for f in samples]
            assert all(len(r.sequences[0].tokens) == long.max_tokens for r in results)
            metrics = [(fb.result(timeout=120), step.result(timeout=120).metrics) for fb, step in steps]
            assert [m["step:max"] for _, m in metrics] == [2.0, 3.0]        # each step once, in order
            answered_s = time.monotonic() - cut
            # New work goes on through the balancer meanwhile.
            tc.forward_backward([datum], "cross_entropy").result(timeout=60)
            assert tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=60).metrics["step:max"] == 4.0
        finally:
            cluster.hosts["db"].heal(cluster.hosts["gateway-2"])
        healed = time.monotonic()
        _wait_for(lambda: health()[urls[1]]["up"], "gateway-2 never came back", 60)
        back_s = time.monotonic() - healed
        sent = httpx.get(balanced + "/_balancer/stats").json()[urls[1]]
        out = sc.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=4)).result()
        assert len(out.sequences[0].tokens) == 4
        assert httpx.get(balanced + "/_balancer/stats").json()[urls[1]] != sent      # it serves again
    finally:
        balancer.kill()
    assert re.search(r"OperationalError|database unreachable", second.text()[gateway_2_at:])
    print(f"database cut off from gateway-2: its /api/v1/healthz: {seen}; the balancer dropped it "
          f"{dropped_s:.1f} s after the cut ({health_log(balancer)}); every "
          f"future answered {answered_s:.1f} s after it; back in the balancer {back_s:.1f} s after the heal")
