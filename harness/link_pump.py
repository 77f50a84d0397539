"""An emulated link: Ethernet frames pumped in userspace between two TAP devices, one inside a
host's network namespace (its eth0) and one on the bridge, delayed and dropped on the way.

It stands in for `tc netem` where the kernel has no netem (nor any other delaying qdisc): the
kernels on both ends still see every frame as on a wire, so TCP's own retransmits, window and
timers answer the loss and the delay, whatever the protocol and ports (gloo picks its ports at
run time, which a TCP proxy could not follow). TAP devices carry whole frames no larger than the
MTU with their checksums filled in, so frames pass through unchanged.

    python -m harness.link_pump BRIDGE_TAP NETNS HOST_TAP

reads its settings as JSON lines on stdin ({"delay_ms": 50, "loss": 0.01}: each direction,
each frame) and answers each with a line "ok"; it ends when stdin closes. The TAP devices are
made beforehand (`ip tuntap add ... mode tap`); this process attaches to them.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
CLONE_NEWNET = 0x40000000
FRAME_BYTES = 65536


def open_tap(name: str) -> int:
    """A descriptor on TAP device `name` of this thread's network namespace: each read is one
    frame the kernel sent out of it, each write one frame it receives."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def open_tap_in(netns: str, name: str) -> int:
    """open_tap inside the named namespace (`ip netns`); this process then stays there, which
    the pump does not mind: it only moves frames between descriptors it holds."""
    libc = ctypes.CDLL(None, use_errno=True)
    ns = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(ns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(ns)
    return open_tap(name)


class Direction:
    """Frames read on `source`, written to `sink` once due; a random share lost on the way."""

    def __init__(self, source: int, sink: int):
        self.source, self.sink = source, sink
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.forwarded = self.dropped = 0

    def read(self, delay_s: float, loss: float) -> None:
        while True:
            try:
                frame = os.read(self.source, FRAME_BYTES)
            except BlockingIOError:
                return
            if loss and random.random() < loss:
                self.dropped += 1
            else:
                self.queue.append((time.monotonic() + delay_s, frame))

    def write_due(self) -> float | None:
        """Writes the frames whose time has come; returns when the next one is due."""
        now = time.monotonic()
        while self.queue and self.queue[0][0] <= now:
            _, frame = self.queue.popleft()
            try:
                os.write(self.sink, frame)
                self.forwarded += 1
            except OSError:          # the far end is down (a partition): the frame is lost, as on a wire
                self.dropped += 1
        return self.queue[0][0] if self.queue else None


def pump(bridge_fd: int, host_fd: int) -> None:
    delay_s, loss = 0.0, 0.0
    to_host, from_host = Direction(bridge_fd, host_fd), Direction(host_fd, bridge_fd)
    control = sys.stdin.fileno()
    while True:
        due = [d for d in (to_host.write_due(), from_host.write_due()) if d is not None]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        readable, _, _ = select.select([bridge_fd, host_fd, control], [], [], timeout)
        if control in readable:
            line = sys.stdin.readline()
            if not line:
                return
            settings = json.loads(line)
            delay_s, loss = settings.get("delay_ms", 0) / 1e3, settings.get("loss", 0.0)
            print(json.dumps({"ok": True, "forwarded": to_host.forwarded + from_host.forwarded,
                              "dropped": to_host.dropped + from_host.dropped}), flush=True)
        if bridge_fd in readable:
            to_host.read(delay_s, loss)
        if host_fd in readable:
            from_host.read(delay_s, loss)


def main(bridge_tap: str, netns: str, host_tap: str) -> None:
    bridge_fd = open_tap(bridge_tap)
    host_fd = open_tap_in(netns, host_tap)
    print("READY", flush=True)
    pump(bridge_fd, host_fd)


if __name__ == "__main__":
    main(*sys.argv[1:4])
