"""The multi-host harness (harness/hosts.py) on its own: hosts that are apart, link controls that
do what they say (measured over real TCP between the namespaces), and a teardown that leaves
nothing, even when the test inside it fails. Skips, with the reason, where namespaces cannot be
made (not root, no iproute2, a container without CAP_NET_ADMIN)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from harness import hosts

pytestmark = pytest.mark.skipif(bool(hosts.unavailable()), reason=f"{hosts.unavailable()}")

# Echoes one message per connection, on port 5000 of its host.
ECHO = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5000)); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(1 << 16)); c.close()
"""
# Connects to ARGV[1]:5000 and prints the round trip of one message, or "unreachable".
PROBE = """
import socket, sys, time
t = time.monotonic()
try:
    with socket.create_connection((sys.argv[1], 5000), timeout=float(sys.argv[2])) as s:
        s.sendall(b"ping"); assert s.recv(16) == b"ping"
    print(time.monotonic() - t)
except OSError:
    print("unreachable")
"""
# Sends ARGV[2] MiB to ARGV[1]:5001 and prints the seconds it took (until the receiver closed).
SEND = """
import socket, sys, time
with socket.create_connection((sys.argv[1], 5001), timeout=60) as s:
    t = time.monotonic(); s.sendall(b"x" * (int(sys.argv[2]) << 20)); s.shutdown(socket.SHUT_WR); s.recv(1)
print(time.monotonic() - t)
"""
SINK = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(); print("listening", flush=True)
c, _ = s.accept()
while c.recv(1 << 20): pass
c.close()
"""


def _serve(host: hosts.Host, code: str) -> subprocess.Popen:
    proc = host.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def _probe(host: hosts.Host | None, target: hosts.Host, timeout_s: float = 1.5) -> float | None:
    argv = [sys.executable, "-c", PROBE, target.address, str(timeout_s)]
    out = (host.run(argv) if host else subprocess.run(argv, capture_output=True, text=True)).stdout.strip()
    return None if out == "unreachable" else float(out)


def _leftovers(network_id: str) -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line for line in (namespaces + links).splitlines() if f"tinkerd-{network_id}-" in line
            or f"tk{network_id}" in line]


def test_hosts_are_apart_and_reach_each_other_over_the_bridge():
    with hosts.Network() as net:
        a, b = net.add_host("alpha"), net.add_host("beta", emulated=True)
        assert len({net.address, a.address, b.address}) == 3
        assert a.run(["hostname"]).stdout.strip() == "alpha"
        # Each host has its own interfaces, no default route, and a /dev/shm of its own.
        assert a.run(["ip", "-o", "-4", "addr", "show", "eth0"]).stdout.split()[3] == f"{a.address}/24"
        assert "default" not in a.run(["ip", "route"]).stdout
        assert a.run(["ls", "/sys/class/net"]).stdout.split() == ["eth0", "lo"]
        a.run(["sh", "-c", "touch /dev/shm/only-on-alpha"])
        assert "only-on-alpha" not in b.run(["ls", "/dev/shm"]).stdout
        assert not os.path.exists("/dev/shm/only-on-alpha")
        _serve(b, ECHO)
        assert _probe(a, b) is not None          # host to host, across the bridge
        assert _probe(None, b) is not None       # the root namespace (the test) to a host


def test_partition_drops_silently_and_heal_restores():
    with hosts.Network() as net:
        a, b, c = net.add_host("alpha"), net.add_host("beta"), net.add_host("gamma", emulated=True)
        _serve(b, ECHO)
        _serve(c, ECHO)
        b.partition()                            # from everyone
        assert _probe(a, b) is None and _probe(None, b) is None
        assert _probe(a, c) is not None
        b.heal()
        assert _probe(a, b) is not None
        b.partition(a)                           # from alpha only
        assert _probe(a, b) is None
        assert _probe(c, b) is not None and _probe(None, b) is not None
        b.heal(a)
        assert _probe(a, b) is not None
        c.partition()                            # an emulated link is cut by the kernel too
        assert _probe(a, c) is None
        c.heal()
        assert _probe(a, c) is not None


def test_delay_loss_and_rate_are_what_was_asked():
    with hosts.Network() as net:
        a, b = net.add_host("alpha"), net.add_host("beta", emulated=True)
        _serve(b, ECHO)
        base = min(_probe(a, b) for _ in range(3))
        b.shape(delay_ms=40)
        # connect + one message: two round trips, each 2 x 40 ms longer
        delayed = min(_probe(a, b) for _ in range(3))
        assert 0.16 <= delayed < base + 0.4, (base, delayed)
        b.shape(loss=0.2)
        sink = _serve(b, SINK)
        before = b.pump_settings()
        a.run([sys.executable, "-c", SEND, b.address, "1"], timeout=120)
        sink.wait(timeout=30)
        counts = b.pump_settings()
        forwarded, dropped = counts["forwarded"] - before["forwarded"], counts["dropped"] - before["dropped"]
        assert 0.1 < dropped / (forwarded + dropped) < 0.3, counts      # and TCP still delivered it all
        b.shape(rate_mbit=16)                    # the kernel's htb, both ends
        sink = _serve(b, SINK)
        seconds = float(a.run([sys.executable, "-c", SEND, b.address, "4"], timeout=120).stdout)
        sink.wait(timeout=30)
        assert 1.6 < seconds < 4, seconds        # 4 MiB at 16 Mbit/s: 2.1 s
        with pytest.raises(hosts.LinkError, match="no netem"):
            a.shape(delay_ms=10)


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_teardown_leaves_nothing_even_when_the_test_fails():
    with pytest.raises(ZeroDivisionError):
        with hosts.Network() as net:
            a = net.add_host("alpha")
            b = net.add_host("beta", emulated=True)
            # An orphan in a session of its own (as torchrun's ranks are), known to nobody.
            a.run(["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 &"])
            orphans = [int(p) for p in subprocess.run(["ip", "netns", "pids", a.netns], capture_output=True,
                                                      text=True).stdout.split()]
            service = b.service("sleeper", ["sleep", "600"], "/tmp", dict(os.environ))
            pump = b.pump
            1 / 0
    assert orphans and _leftovers(net.id) == []
    assert all(_gone(pid) for pid in orphans)
    assert service.proc.poll() is not None and pump.poll() is not None


def test_a_killed_run_is_swept_by_the_next():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{dead.pid:x}-0"
    subprocess.run(["ip", "netns", "add", f"tinkerd-{stale}-alpha"], check=True)
    subprocess.run(["ip", "link", "add", f"tk{stale}b", "type", "bridge"], check=True)
    with hosts.Network():
        assert _leftovers(stale) == []
