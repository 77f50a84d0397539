"""The gateway's ports `tinkerd up` picks before it starts the gateway (launcher/up.py free_port):
free, and outside the kernel's ephemeral range, so the trainer, the samplers and
torch.distributed binding port 0 meanwhile are never given one (a stack failed to start with the
gateway's "Address already in use" when it was drawn from that range)."""

from __future__ import annotations

import contextlib
import socket

import pytest
from conftest import run_tinkerd

from launcher import up



def test_the_gateways_port_is_free_and_no_port_0_bind_meanwhile_gets_it():
    low, high = up._ephemeral_ports()
    ports = {up.free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (sorted(ports), low)
    port = ports.pop()
    with contextlib.ExitStack() as held:          # 500 services binding port 0 before the gateway binds
        given = set()
        for _ in range(500):
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            given.add(s.getsockname()[1])
        assert port not in given and all(low <= p <= high for p in given)
        with socket.socket() as gateway:
            gateway.bind(("127.0.0.1", port))


@pytest.mark.parametrize("command, flag", [("up", "--port"), ("up", "--internal-port"), ("gateway", "--port"),
                                           ("gateway", "--internal-port")])
def test_a_port_another_process_holds_is_refused_before_anything_starts(tmp_path, tiny_model_dir, command, flag):
    """Not a gateway that dies after the trainer and the samplers have started (seconds later, with
    a traceback in its log): the flag to change, at once, and no state dir made."""
    state = tmp_path / "state"
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        argv = [command, "--base-model", tiny_model_dir, "--state-dir", str(state), flag, str(port)]
        if command == "gateway":
            argv += ["--trainer", "127.0.0.1:1"]
        r = run_tinkerd(*argv)
    assert r.returncode == 1, (r.stdout, r.stderr)
    where = "--host/--port" if flag == "--port" else "--internal-host/--internal-port"
    assert f"cannot listen on 127.0.0.1:{port} ({where}): Address already in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not state.exists()


@pytest.mark.parametrize("command", ["up", "trainer", "sampler"])
def test_a_metrics_port_another_process_holds_is_refused_before_the_model_loads(tmp_path, tiny_model_dir, command):
    """The trainer found it taken after loading its model (a bind traceback in its log; minutes for
    a large model), and `up` had started everything by then."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        r = run_tinkerd(command, "--base-model", tiny_model_dir, "--state-dir", str(tmp_path / "state"),
                        "--metrics-port", str(port))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"cannot serve /metrics on 127.0.0.1:{port} (--metrics-port): Address already in use" in r.stderr
    assert "Traceback" not in r.stderr and "READY" not in r.stdout, r.stderr
    assert command != "up" or not (tmp_path / "state").exists()
