"""The gateway's ports `tinkerd up` picks before it starts the gateway (launcher/up.py free_port):
free, and outside the kernel's ephemeral range, so the trainer, the samplers and
torch.distributed binding port 0 meanwhile are never given one (a stack failed to start with the
gateway's "Address already in use" when it was drawn from that range)."""

from __future__ import annotations

import contextlib
import socket

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
