"""Addresses across hosts: the rule a service follows for the address it tells others
(tinkerd.rpc.advertised_host), the interface a weight stream's receiver listens on, and the
start-up refusals of addresses that cannot work (tests/e2e/test_multi_host.py runs them on hosts
of their own)."""

from __future__ import annotations

import socket

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
