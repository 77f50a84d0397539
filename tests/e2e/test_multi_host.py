"""The topology users run, each service on a host of its own (harness/hosts.py: network
namespaces on a bridge, each with its own address, hostname and /dev/shm), and the faults a real
network brings, seen from the SDK in the root namespace.

    host "trainer"    tinkerd trainer        10.x.y.2:50051 (metrics :9100)
    host "sampler-1"  tinkerd sampler        10.x.y.3:50052  emulated link: delay and loss
    host "sampler-2"  tinkerd sampler        10.x.y.4:50052
    host "db"         PostgreSQL             10.x.y.5:5432
    host "gateway"    tinkerd gateway        10.x.y.6:8000, internal :8001

Every service listens on its host's address and advertises nothing else (no flag names an
advertised address: the rule tinkerd.rpc.advertised_host applies). The state dir is shared (a
shared filesystem, as deployments have); /dev/shm is not, so a weight push can only travel by
gloo over the bridge.
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
LEASE_S = 2.0


@dataclasses.dataclass
class Cluster:
    net: hosts.Network
    hosts: dict[str, hosts.Host]
    services: dict[str, Service]
    db_url: str
    token: str

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
        with urllib.request.urlopen(f"http://{self.address('trainer', METRICS_PORT)}/metrics", timeout=10) as r:
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
                for name in ("trainer", "sampler-1", "sampler-2", "db", "gateway")}
        at = {name: h.address for name, h in made.items()}
        services = {"trainer": made["trainer"].service("trainer", [
            *tinkerd, "trainer", *common, *exact, "--listen", f"{at['trainer']}:{TRAINER_PORT}",
            "--metrics-port", str(METRICS_PORT)], logs, env)}
        for name in ("sampler-1", "sampler-2"):
            services[name] = made[name].service(name, [
                *tinkerd, "sampler", *common, *exact, *TINY_KV_CACHE, "--merged-slots", "0",
                "--listen", f"{at[name]}:{SAMPLER_PORT}",
                "--register-with", f"http://{at['gateway']}:{INTERNAL_PORT}"], logs, env)
        db_url = stack.enter_context(postgres_on(made["db"], root / "pg", "tinkerd"))
        services["gateway"] = made["gateway"].service("gateway", [
            *tinkerd, "gateway", *common, "--trainer", f"{at['trainer']}:{TRAINER_PORT}",
            "--host", at["gateway"], "--port", str(GATEWAY_PORT), "--internal-host", at["gateway"],
            "--internal-port", str(INTERNAL_PORT), "--db-url", db_url, "--no-auth",
            "--future-lease-s", str(LEASE_S)], logs, env)
        for service in services.values():
            service.ready()
        cluster = Cluster(net, made, services, db_url, open(token_file).read().strip())
        replicas = [cluster.address(name, SAMPLER_PORT) for name in ("sampler-1", "sampler-2")]
        _wait_for(lambda: all(cluster.pool().get(r, {}).get("alive") for r in replicas),
                  f"the replicas never joined the pool: {cluster.pool()}")
        yield cluster


@pytest.fixture(scope="module")
def service(cluster):
    import tinker

    # The gateway runs --no-auth; the key is passed, not set in os.environ, which later tests read.
    return tinker.ServiceClient(base_url=cluster.url, api_key="tml-no-auth")


def _train_one_step(service, tiny_model_dir):
    from tinker import types

    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=3).result()
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
    sc = tc.save_weights_and_get_sampling_client()
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
        assert re.search(rf"weight transport to {re.escape(replica)}: gloo \(hosts trainer and {name}, cpu",
                         trainer_log), trainer_log[-3000:]
        sampler_log = cluster.services[name].text()
        at = re.escape(cluster.hosts[name].address)
        assert re.search(rf"weight group \S+ with {re.escape(cluster.hosts['trainer'].address)}:\d+ formed "
                         rf"\(gloo, this end on {at}\)", sampler_log), sampler_log[-3000:]
        assert re.search(r"snapshot \S+: \d+ tensors in [\d.]+ ms \(gloo join", sampler_log)
    assert re.search(r'tinkerd_trainer_weight_links_total\{transport="gloo"\} [1-9]', cluster.trainer_metrics())
    assert "shm" not in {t for _, t, _ in _pushes(trainer_log)}
    # What the replicas registered is what the others reach them at: no loopback leaked.
    assert cluster.registered() == replicas
    assert not [line for line in trainer_log.splitlines() if "127.0.0.1" in line and "stream" in line]
