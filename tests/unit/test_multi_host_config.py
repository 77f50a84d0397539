"""Addresses across hosts: the rule a service follows for the address it tells others
(tinkerd.rpc.advertised_host), the interface a weight stream's receiver listens on, and the
start-up refusals of addresses that cannot work (tests/e2e/test_multi_host.py runs them on hosts
of their own)."""

from __future__ import annotations

import os
import socket

import pytest

from conftest import run_tinkerd
from tinkerd.rpc import advertised_host, is_local_address
from tinkerd.weight_stream import local_address_to


def test_the_advertised_host_rule():
    assert advertised_host("127.0.0.1:0") == advertised_host("[::1]:50051") == "127.0.0.1"
    assert advertised_host("localhost:50051") == "127.0.0.1"
    assert advertised_host("10.1.2.3:50051") == "10.1.2.3"
    wildcard = advertised_host("0.0.0.0:50051")
    assert wildcard in (socket.gethostname(), socket.gethostbyname(socket.gethostname()))
    assert is_local_address("127.0.0.1") and not is_local_address("192.0.2.1")      # TEST-NET-1


def test_a_receiver_listens_where_its_route_to_the_sender_leaves():
    assert local_address_to("127.0.0.1") == "127.0.0.1"


def test_a_replica_will_not_register_loopback_with_a_gateway_on_another_host(tiny_model_dir, tmp_path):
    done = run_tinkerd("sampler", "--base-model", tiny_model_dir, "--state-dir", str(tmp_path),
                       "--listen", "127.0.0.1:0", "--register-with", "http://192.0.2.1:8001")
    assert done.returncode != 0
    assert "would register 127.0.0.1:0 with http://192.0.2.1:8001, another host" in done.stderr, done.stderr


def test_a_trainer_will_not_advertise_an_address_that_is_not_its_own(tiny_model_dir, tmp_path):
    done = run_tinkerd("trainer", "--base-model", tiny_model_dir, "--state-dir", str(tmp_path / "state"),
                       "--listen", "127.0.0.1:0", "--advertise-host", "192.0.2.1")
    assert done.returncode != 0
    assert "--advertise-host 192.0.2.1 is not an address of this host" in done.stderr, done.stderr


def test_a_rank_whose_master_addr_it_cannot_reach_says_so(tiny_model_dir, tmp_path):
    """A rank on a host with no route to MASTER_ADDR (a host of harness/hosts.py: no default route)."""
    import os
    import sys

    import pytest

    from harness import hosts

    if reason := hosts.unavailable():
        pytest.skip(f"no network namespaces here: {reason}")
    with hosts.Network() as net:
        rank = net.add_host("trainer-1")
        done = rank.run([sys.executable, "-m", "launcher.cli", "trainer", "--base-model", tiny_model_dir,
                         "--state-dir", str(tmp_path), "--listen", f"{rank.address}:50051"], timeout=120,
                        env={**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": "1",
                             "LOCAL_RANK": "0", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"})
    assert done.returncode != 0
    assert "MASTER_ADDR 192.0.2.1 is not reachable from this host" in done.stderr, done.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_1(master: str, port: int, tiny_model_dir: str, state_dir, listen: str, run=None):
    """`tinkerd trainer` as rank 1 of 2 with MASTER_ADDR:MASTER_PORT given (--master-timeout-s 1):
    (CompletedProcess, seconds it ran)."""
    import os
    import subprocess
    import sys
    import time

    argv = [sys.executable, "-m", "launcher.cli", "trainer", "--base-model", tiny_model_dir, "--state-dir",
            str(state_dir), "--listen", listen, "--master-timeout-s", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": master, "MASTER_PORT": str(port)}
    began = time.monotonic()
    done = (run or (lambda argv, **kw: subprocess.run(argv, capture_output=True, text=True, **kw)))(
        argv, timeout=120, env=env)
    return done, time.monotonic() - began


def test_a_rank_whose_master_refuses_its_connection_says_so_within_its_timeout(monkeypatch):
    """MASTER_ADDR routes, nothing listens at MASTER_PORT (a closed port on this host): the rank's
    start-up check (what `tinkerd trainer` runs before torch's own connect, which would wait 30
    minutes) ends it within --master-timeout-s, naming both."""
    import time

    from trainer_service.server import wait_for_master

    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    began = time.monotonic()
    with pytest.raises(SystemExit) as ended:
        wait_for_master(2, 1, 1.0)
    assert f"nothing answers at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port}, the job's store, after 1 s " \
           f"([Errno 111] Connection refused)" in str(ended.value), ended.value
    assert time.monotonic() - began < 5
    wait_for_master(2, 0, 1.0)          # rank 0 (or torchrun's agent) is the store: nothing to wait for


def test_a_rank_whose_master_is_silent_says_so_within_its_timeout(tiny_model_dir, tmp_path):
    """MASTER_ADDR routes and every packet to it is dropped (the host cut off: a SYN is never
    answered), the case torch's connect waits out in silence."""
    import pytest

    from harness import hosts

    if reason := hosts.unavailable():
        pytest.skip(f"no network namespaces here: {reason}")
    with hosts.Network() as net:
        rank = net.add_host("trainer-1")
        rank.partition()                   # from every host and the bridge's address, MASTER_ADDR here
        done, took = _rank_1(net.address, 29500, tiny_model_dir, tmp_path, f"{rank.address}:50051", rank.run)
    assert done.returncode != 0
    assert f"nothing answers at MASTER_ADDR:MASTER_PORT {net.address}:29500, the job's store, after 1 s (timed out)" \
        in done.stderr, done.stderr[-2000:]
    assert took < 30, took


SECRET, OTHER_SECRET = "the-gateways-service-secret", "another-hosts-service-secret"


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory):
    """A real `tinkerd gateway` (its internal listener on loopback) holding SECRET, whose trainer
    address is served by the trainer's own gRPC server (tinkerd.rpc.create_server, health
    SERVING) holding OTHER_SECRET: (internal URL, public URL, its log's path, the trainer's address)."""
    import subprocess
    import sys

    from tinkerd.health import ServiceHealth
    from tinkerd.rpc import ServiceAuth, create_server

    tmp = tmp_path_factory.mktemp("gateway")
    (tmp / "secret").write_text(SECRET)
    trainer, port = create_server("127.0.0.1:0", max_workers=4, auth=ServiceAuth(OTHER_SECRET, role="trainer"))
    ServiceHealth(trainer, "tinkerd.v1.Trainer").serving()
    trainer.start()
    log = tmp / "gateway.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "gateway", "--base-model", tiny_model_dir,
                                 "--state-dir", str(tmp / "state"), "--trainer", f"127.0.0.1:{port}", "--port", "0",
                                 "--internal-port", "0", "--service-token-file", str(tmp / "secret"), "--no-auth"],
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ports = {}
        for line in proc.stdout:
            if line.startswith(("INTERNAL gateway", "READY gateway")):
                ports[line.split()[0]] = int(line.split()[2])
            if "READY" in ports:
                break
        assert "READY" in ports, log.read_text()[-3000:]
        yield (f"http://127.0.0.1:{ports['INTERNAL']}", f"http://127.0.0.1:{ports['READY']}", log,
               f"127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        trainer.stop(0)


def _refusal_of(gateway_url: str, address: str, token: str) -> tuple[str, float]:
    """A replica's registration (sampler_service/registration.py, as `tinkerd sampler` runs it)
    run until the gateway has refused it enough to stop: (why, seconds it took)."""
    import threading
    import time

    from sampler_service.registration import Registration

    refused = threading.Event()
    registration = Registration([gateway_url], address, token, on_refused=lambda _: refused.set())
    began = time.monotonic()
    registration.start()
    try:
        assert refused.wait(timeout=60), "the registration was never refused"
        return registration.refused, time.monotonic() - began
    finally:
        registration.stop()


def test_a_replica_whose_token_the_gateway_does_not_take_stops_naming_the_mismatch(gateway):
    from tinkerd import service_roles

    internal, _, _, _ = gateway
    why, took = _refusal_of(internal, "127.0.0.1:1", service_roles.derive(OTHER_SECRET, "sampler", "gateway"))
    assert "refused to register this replica (127.0.0.1:1): HTTP 403: the sampler service's token is not one this " \
           "gateway accepts: a service token mismatch" in why, why
    assert "--service-token-file" in why and SECRET not in why and OTHER_SECRET not in why
    assert took < 10, took          # REFUSALS_BEFORE_EXIT tries, RETRY_S apart


def test_a_replica_the_gateway_cannot_reach_is_told_and_stops(gateway):
    """A replica registering an address where nothing answers (a closed port here; across hosts a
    wrong interface or a firewall): admitted at first, refused at a heartbeat once the pool's
    health checks of it have failed, with the address and the flag to fix; it leaves the pool."""
    import json
    import re
    import time
    import urllib.request

    from gateway.sampler_pool import LOST_AFTER_CHECKS
    from tinkerd import service_roles

    internal, _, _, _ = gateway
    token = service_roles.derive(SECRET, "sampler", "gateway")
    address = f"127.0.0.1:{_free_port()}"
    why, took = _refusal_of(internal, address, token)
    said = re.search(rf"refused to register this replica \({address}\): HTTP 400: this gateway cannot reach the "
                     rf"sampler replica at {address}, the address it registered \(its last (\d+) health checks "
                     rf"failed, and one made now: UNAVAILABLE: .*Connection refused\)", why)
    assert said and int(said.group(1)) >= LOST_AFTER_CHECKS, why
    assert "--advertise-address HOST:PORT" in why
    assert took < 30, took
    listing = urllib.request.Request(f"{internal}/internal/v1/samplers/list",
                                     headers={"authorization": f"Bearer {token}"})

    def pool() -> list[str]:
        with urllib.request.urlopen(listing, timeout=10) as r:
            return [m["address"] for m in json.load(r)["samplers"]]
    deadline = time.monotonic() + 10            # stopped, it deregistered: gone at the pool's next refresh
    while address in pool():
        assert time.monotonic() < deadline, pool()
        time.sleep(0.2)


def test_a_gateway_whose_trainer_refuses_its_token_says_so(gateway):
    """The trainer's open health check passes; the gateway's token is refused: healthz shows the
    trainer down and the log says why, from the start."""
    import json
    import time
    import urllib.error
    import urllib.request

    _, public, log, trainer = gateway
    with pytest.raises(urllib.error.HTTPError) as down:
        urllib.request.urlopen(f"{public}/api/v1/healthz", timeout=10)
    assert down.value.code == 503 and json.load(down.value)["trainer"] == "not serving"
    deadline = time.monotonic() + 10
    while log.read_text().count(f"service token mismatch with the trainer at {trainer}") < 2:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    assert SECRET not in log.read_text() and OTHER_SECRET not in log.read_text()
