"""The address a sampler replica registers with the gateways (sampler_service/registration.py):
--advertise-address when given; 127.0.0.1 for a loopback --listen (`tinkerd up`'s replicas);
the one interface it listens on; for 0.0.0.0, this host's IP as its hostname resolves (a
container's or pod's), or the hostname where that resolves to loopback."""

from __future__ import annotations

import ipaddress
import socket

from sampler_service.registration import advertised_address


def test_the_advertised_address():
    assert advertised_address("127.0.0.1:0", 41234) == "127.0.0.1:41234"
    assert advertised_address("[::1]:0", 41234) == "127.0.0.1:41234"
    assert advertised_address("10.1.2.3:50052", 50052) == "10.1.2.3:50052"
    assert advertised_address("0.0.0.0:50052", 50052, "10.0.0.7:50052") == "10.0.0.7:50052"
    host, port = advertised_address("0.0.0.0:50052", 50052).rsplit(":", 1)
    assert port == "50052"
    name = socket.gethostname()
    try:
        resolved = socket.gethostbyname(name)
    except OSError:
        resolved = None
    if resolved is None or ipaddress.ip_address(resolved).is_loopback:
        assert host == name
    else:
        assert host == resolved
