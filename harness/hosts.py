"""Many hosts on one machine: each "host" a Linux network namespace with its own address on a
bridge, and a hostname, /dev/shm and /sys of its own, so the services on it see what they would
see on a host of their own (tinkerd/weight_transport.py tells hosts apart by hostname; a shared
/dev/shm would let the same-host transport work by accident).

    with Network() as net:
        a, b = net.add_host("trainer"), net.add_host("sampler", emulated=True)
        svc = a.service("trainer", [...], log_dir, env)     # harness.services.Service, on host a
        b.shape(delay_ms=50, loss=0.01)      # each way: the round trip gains 100 ms
        b.partition(); b.heal()              # from every host, or b.partition(a) from a only

The test process stays in the root namespace, which has the bridge's first address: it reaches
every host as a client from outside would. Nothing has a default route and the root namespace
forwards nothing, so no traffic leaves the bridge.

Link controls, and what makes each:
- partition / heal: the kernel. Frames are dropped silently (a `pfifo limit 0` queue, or an
  htb class holding one, selected by u32 on the peer's address) on both ends of the host's
  link, as a dead switch port would; the carrier stays up, so TCP sees a silent network, not a
  closed one.
- rate: the kernel (htb on both ends).
- delay and loss: where the kernel had `netem` these would be its; on kernels without it (the
  2-core VM this was written on) a host made with `emulated=True` has a userspace link instead
  of a veth pair (harness/link_pump.py): frames go through a process that delays and drops
  them, the kernels on both ends answer as on a real slow wire. A plain host refuses delay and
  loss rather than pretend.

Teardown kills every process in each namespace (whoever started it), then deletes namespaces,
links and bridge; it runs on `close()` / leaving the `with`, even when the test failed. A run
killed before that leaves names carrying its pid; the next Network sweeps those whose process
is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

from harness.services import ROOT, Service
from tinkerd.process import stop_with_parent

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
MS_REC, MS_PRIVATE, MNT_DETACH = 0x4000, 1 << 18, 2
NETNS_DIR = "/var/run/netns"
HOST_DEVICE = "eth0"            # the host's end of its link, inside its namespace
_STALE = re.compile(r"^(?:tinkerd-|tk)([0-9a-f]+)-")
_networks = itertools.count()


class LinkError(RuntimeError):
    """A link control this host's link cannot do."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def unavailable() -> str | None:
    """Why hosts cannot be made here (the reason a test skips with), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"tinkerd-{os.getpid():x}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    try:
        veth = _run("ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be made here: {veth.stderr.strip()}"
        if not os.path.exists("/dev/net/tun"):
            return "/dev/net/tun is missing (emulated links need TAP devices)"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_all_in(netns: str) -> None:
    """SIGKILLs every process in the namespace, however it got there, until none is left."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [int(p) for p in _run("ip", "netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    raise RuntimeError(f"processes in {netns} survived SIGKILL for 30 s")


def sweep_stale() -> None:
    """Deletes namespaces and links an earlier run left behind (its process is gone)."""
    names = os.listdir(NETNS_DIR) if os.path.isdir(NETNS_DIR) else []
    for name in names:
        if (m := _STALE.match(name)) and m.group(0).startswith("tinkerd-") and not _alive(int(m.group(1), 16)):
            _kill_all_in(name)
            _run("ip", "netns", "del", name, check=False)
    for line in _run("ip", "-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if (m := _STALE.match(name)) and name.startswith("tk") and not _alive(int(m.group(1), 16)):
            _run("ip", "link", "del", name, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10/8 that no route of this machine touches."""
    taken = [ipaddress.ip_network(word, strict=False)
             for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", _run("ip", "-4", "route", "show", "table",
                                                                             "all").stdout)]
    for _ in range(1000):
        subnet = ipaddress.ip_network(f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise RuntimeError("no free /24 in 10.100-250.x.x")


class Network:
    """A bridge in the root namespace (which gets the subnet's first address) and the hosts on it."""

    def __init__(self):
        sweep_stale()
        self.id = f"{os.getpid():x}-{next(_networks)}"
        self.subnet = _free_subnet()
        self.bridge = f"tk{self.id}b"
        self.address = str(self.subnet[1])
        self.hosts: dict[str, Host] = {}
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        try:
            _run("ip", "addr", "add", f"{self.address}/{self.subnet.prefixlen}", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            _run("ip", "link", "del", self.bridge, check=False)
            raise

    def add_host(self, name: str, *, emulated: bool = False) -> Host:
        """A new host: its namespace, its address, its link to the bridge (a veth pair, or with
        `emulated` one through harness/link_pump.py, which can add delay and loss)."""
        if name in self.hosts or not re.fullmatch(r"[a-z][a-z0-9-]{0,30}", name):
            raise ValueError(f"host name {name!r} is taken or not a lowercase DNS label")
        host = Host(self, name, str(self.subnet[2 + len(self.hosts)]), len(self.hosts), emulated)
        self.hosts[name] = host
        try:
            host.create()
        except BaseException:
            host.close()
            raise
        return host

    def close(self) -> None:
        errors = []
        for host in reversed(list(self.hosts.values())):
            try:
                host.close()
            except Exception as e:  # noqa: BLE001 - every host is torn down; the first error is raised after
                errors.append(e)
        _run("ip", "link", "del", self.bridge, check=False)
        if errors:
            raise errors[0]

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Host:
    def __init__(self, network: Network, name: str, address: str, index: int, emulated: bool):
        self.network, self.name, self.address, self.emulated = network, name, address, emulated
        self.netns = f"tinkerd-{network.id}-{name}"
        self.outside = f"tk{network.id}{'t' if emulated else 'v'}{index}"      # the bridge's end
        self.pump: subprocess.Popen | None = None
        self.services: list[Service] = []
        self.blocked: set[str] = set()          # peers' addresses; "*": every one
        self.rate_mbit = 0.0
        self.delay_ms, self.loss = 0.0, 0.0

    # -- making and unmaking ------------------------------------------------------------------

    def create(self) -> None:
        net = self.network
        _run("ip", "netns", "add", self.netns)
        if self.emulated:
            _run("ip", "tuntap", "add", "dev", self.outside, "mode", "tap")
            _run("ip", "-n", self.netns, "tuntap", "add", "dev", HOST_DEVICE, "mode", "tap")
        else:
            _run("ip", "link", "add", self.outside, "type", "veth", "peer", "name", HOST_DEVICE, "netns", self.netns)
        _run("ip", "link", "set", self.outside, "master", net.bridge, "up")
        _run("ip", "-n", self.netns, "addr", "add", f"{self.address}/{net.subnet.prefixlen}", "dev", HOST_DEVICE)
        _run("ip", "-n", self.netns, "link", "set", HOST_DEVICE, "up")
        _run("ip", "-n", self.netns, "link", "set", "lo", "up")
        if self.emulated:
            self.pump = subprocess.Popen([sys.executable, "-m", "harness.link_pump", self.outside, self.netns,
                                          HOST_DEVICE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         cwd=ROOT, preexec_fn=stop_with_parent())
            if self.pump.stdout.readline().strip() != "READY":
                raise RuntimeError(f"the link pump of host {self.name} did not start (exit {self.pump.wait()})")

    def close(self) -> None:
        """Every process on this host killed, then its namespace and link deleted."""
        for service in self.services:
            with contextlib.suppress(Exception):
                service.kill()
        if os.path.exists(os.path.join(NETNS_DIR, self.netns)):
            _kill_all_in(self.netns)
        if self.pump is not None:
            self.pump.stdin.close()
            try:
                self.pump.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.pump.kill()
                self.pump.wait()
        _run("ip", "netns", "del", self.netns, check=False)
        _run("ip", "link", "del", self.outside, check=False)

    # -- running things on it -----------------------------------------------------------------

    def enter(self):
        """For Popen's preexec_fn: the child moves into this host (its network namespace) and
        gets a hostname, a /sys showing this host's interfaces and an empty /dev/shm of its own
        (new UTS and mount namespaces)."""
        libc = ctypes.CDLL(None, use_errno=True)        # looked up here: the child only calls it
        path, hostname = os.path.join(NETNS_DIR, self.netns).encode(), self.name.encode()

        def check(result: int, what: str) -> None:
            if result != 0:
                message = f"entering host {self.name}: {what}: {os.strerror(ctypes.get_errno())}\n"
                os.write(2, message.encode())
                raise OSError(ctypes.get_errno(), message)

        def in_child() -> None:
            fd = os.open(path, os.O_RDONLY)
            check(libc.setns(fd, CLONE_NEWNET), "setns")
            os.close(fd)
            check(libc.unshare(CLONE_NEWUTS | CLONE_NEWNS), "unshare")
            check(libc.sethostname(hostname, len(hostname)), "sethostname")
            check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
            check(libc.umount2(b"/sys", MNT_DETACH), "unmounting /sys")
            check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mounting /sys")
            check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"mode=1777"), "mounting /dev/shm")
        return in_child

    def service(self, name: str, command: list[str], log_dir, env: dict) -> Service:
        """A harness.services.Service run on this host; killed with the host if still running."""
        service = Service(name, command, log_dir, env, enter=self.enter())
        self.services.append(service)
        return service

    def run(self, argv: list[str], *, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """A short command on this host, run to its end (output captured as text)."""
        enter, stop = self.enter(), stop_with_parent()
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              preexec_fn=lambda: (stop(), enter()), **kwargs)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """A process on this host; the caller owns it, the host kills it at close if it lives."""
        enter, stop = self.enter(), stop_with_parent()
        return subprocess.Popen(argv, cwd=kwargs.pop("cwd", ROOT), preexec_fn=lambda: (stop(), enter()), **kwargs)

    # -- link controls ------------------------------------------------------------------------

    def partition(self, *peers: Host) -> None:
        """Drops every packet between this host and `peers` (every other host and the root
        namespace when none are named), both ways, silently."""
        if peers:
            for peer in peers:
                self.blocked.add(peer.address)
                peer.blocked.add(self.address)
                peer._apply()
        else:
            self.blocked.add("*")
        self._apply()

    def heal(self, *peers: Host) -> None:
        """Undoes partition() (of `peers`, or every partition of this host when none are named)."""
        for peer in peers or [h for h in self.network.hosts.values() if self.address in h.blocked]:
            self.blocked.discard(peer.address)
            peer.blocked.discard(self.address)
            peer._apply()
        if not peers:
            self.blocked.clear()
        self._apply()

    def shape(self, *, delay_ms: float = 0.0, loss: float = 0.0, rate_mbit: float = 0.0) -> None:
        """This host's link from now on: `delay_ms` added each way (so the round trip gains
        twice it), a share `loss` of the frames lost each way, at most `rate_mbit` each way
        (0: no limit). Zeros undo it."""
        if (delay_ms or loss) and not self.emulated:
            raise LinkError(f"host {self.name} has a kernel (veth) link: delay and loss need "
                            f"add_host({self.name!r}, emulated=True), this kernel has no netem qdisc")
        if not 0 <= loss < 1 or delay_ms < 0 or rate_mbit < 0:
            raise ValueError(f"delay_ms {delay_ms}, loss {loss}, rate_mbit {rate_mbit}: out of range")
        self.rate_mbit = rate_mbit
        if self.emulated:
            self.pump_settings(delay_ms=delay_ms, loss=loss)
        self._apply()

    def pump_settings(self, **settings) -> dict:
        """Sends settings to the link pump; returns its counters (frames forwarded, dropped)."""
        if self.pump is None:
            raise LinkError(f"host {self.name} has no emulated link")
        if settings:
            self.delay_ms, self.loss = settings.get("delay_ms", 0.0), settings.get("loss", 0.0)
        self.pump.stdin.write(json.dumps({"delay_ms": self.delay_ms, "loss": self.loss}) + "\n")
        self.pump.stdin.flush()
        return json.loads(self.pump.stdout.readline())

    def _apply(self) -> None:
        """The egress queue of both ends of the link, from the partitions and the rate: the
        bridge's end filters what reaches this host (by source), the host's end what it sends
        (by destination)."""
        self._queue([], self.outside, "src")
        self._queue(["-n", self.netns], HOST_DEVICE, "dst")

    def _queue(self, where: list[str], device: str, match: str) -> None:
        tc = ["tc", *where]
        _run(*tc, "qdisc", "del", "dev", device, "root", check=False)
        peers = sorted(self.blocked - {"*"})
        if "*" in self.blocked:
            _run(*tc, "qdisc", "add", "dev", device, "root", "pfifo", "limit", "0")
            return
        if not peers and not self.rate_mbit:
            return
        rate = f"{self.rate_mbit}mbit" if self.rate_mbit else "100gbit"
        _run(*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "1")
        _run(*tc, "class", "add", "dev", device, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
             "quantum", "1514")
        if peers:
            _run(*tc, "class", "add", "dev", device, "parent", "1:", "classid", "1:2", "htb", "rate", "1mbit",
                 "quantum", "1514")
            _run(*tc, "qdisc", "add", "dev", device, "parent", "1:2", "pfifo", "limit", "0")
            for peer in peers:
                _run(*tc, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", match, f"{peer}/32", "flowid", "1:2")
