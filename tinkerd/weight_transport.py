"""Which way a weight snapshot travels from the trainer to one sampler replica.

Each end describes itself as an `Endpoint`: which host (machine and OS namespace) and which
device holds its weights. From the two the trainer picks, per replica, the cheapest transport
both can use:
- "cuda_ipc": one host, one CUDA device. The sampler opens the trainer's CUDA buffer through a
  CUDA IPC handle (NCCL refuses two ranks on one device: "Duplicate GPU detected").
- "nccl": both on CUDA, on different devices (of one host or two).
- "shm": one host, at least one side on the CPU: the chunks go through a /dev/shm file both
  map (a host copy is needed anyway; gloo would add the TCP loopback's).
- "gloo": anything else, over TCP.
The trainer tries them in that order of preference, among those the pair can use; a sampler that
cannot use the chosen one (it refuses with `TransportRefused`, e.g. another /dev/shm in another
container) gets the next. The movers are tinkerd/shared_weights.py (cuda_ipc, shm) and
tinkerd/weight_stream.py (gloo, nccl); the links are kept by trainer_service/weight_push.py.
"""

from __future__ import annotations

import dataclasses
import functools
import socket

import grpc

from tinkerd.errors import ServiceError

CUDA_IPC, NCCL, SHM, GLOO = "cuda_ipc", "nccl", "shm", "gloo"
PREFERENCE = (CUDA_IPC, NCCL, SHM, GLOO)
GROUP_TRANSPORTS = (NCCL, GLOO)      # over a torch.distributed side group (weight_stream.py)
CPU = "cpu"
REFUSED = "weight transport refused"      # how a refusal's details begin


class TransportRefused(ServiceError):
    """The sampler cannot use the transport the manifest names; the trainer tries the next."""
    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, transport: str, reason: str):
        super().__init__(f"{REFUSED}: {transport}: {reason}")


class NoTransport(ConnectionError):
    """No transport reaches a sampler replica; says which hosts, which devices, what was tried."""


def is_refusal(error: grpc.RpcError) -> bool:
    return error.code() == grpc.StatusCode.FAILED_PRECONDITION and (error.details() or "").startswith(REFUSED)


@dataclasses.dataclass(frozen=True)
class Endpoint:
    host: str       # equal for processes that share a machine and its namespaces (host_identity)
    device: str     # "cpu", or "cuda:<the device's UUID>" (device_identity)

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda:")

    def describe(self) -> str:
        return f"host {self.host.split('/')[0] or '?'} ({self.device or '?'})"

    def message(self):
        from tinkerd.v1 import common_pb2

        return common_pb2.WeightEndpoint(host=self.host, device=self.device)

    @classmethod
    def of(cls, message) -> Endpoint:
        """From a WeightEndpoint message (an empty one: an endpoint nothing is known of)."""
        return cls(message.host, message.device)


@functools.lru_cache(maxsize=1)
def host_identity() -> str:
    """The kernel's boot id and the hostname. The boot id alone is equal in every container of a
    machine (it is not namespaced), and containers have their own /dev/shm and IPC namespace;
    the hostname is per UTS namespace, so it tells containers apart (unless run with the host's,
    which usually comes with its IPC too). Where the two still mislead, the sampler's refusal to
    open what it was sent sends the trainer to the next transport."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def device_identity(device) -> str:
    """ "cpu", or the CUDA device's UUID: the same physical GPU whatever index
    CUDA_VISIBLE_DEVICES gives it in each process."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return CPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"


def local_endpoint(device=None) -> Endpoint:
    """This process's endpoint; `device` defaults to hardware.default_device()."""
    from tinkerd import hardware

    return Endpoint(host_identity(), device_identity(hardware.default_device() if device is None else device))


def cuda_index(device: str) -> int:
    """This process's index of the CUDA device `device` (a device_identity) names."""
    import torch

    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if device_identity(torch.device("cuda", i)) == device:
            return i
    raise LookupError(f"{device} is not visible to this process")


def why_not(transport: str, sender: Endpoint, receiver: Endpoint) -> str | None:
    """Why the pair cannot use `transport`; None if it can."""
    same_host = bool(sender.host) and sender.host == receiver.host
    one_card = same_host and sender.on_cuda and sender.device == receiver.device
    if transport == CUDA_IPC and not one_card:
        return "needs both ends on one CUDA device of one host"
    if transport == NCCL and not (sender.on_cuda and receiver.on_cuda):
        return "needs both ends on CUDA"
    if transport == NCCL and one_card:
        return "NCCL refuses two ranks on one device"
    if transport == SHM and not same_host:
        return "needs both ends on one host"
    if transport not in PREFERENCE:
        return "unknown transport"
    return None


def candidates(sender: Endpoint, receiver: Endpoint, allowed=PREFERENCE) -> list[str]:
    """The transports the pair can use, among `allowed`, best first."""
    return [t for t in PREFERENCE if t in allowed and why_not(t, sender, receiver) is None]


def choose(sender: Endpoint, receiver: Endpoint, allowed=PREFERENCE) -> str:
    usable = candidates(sender, receiver, allowed)
    if not usable:
        raise NoTransport(unreachable(sender, receiver, allowed, {}))
    return usable[0]


def unreachable(sender: Endpoint, receiver: Endpoint, allowed, refused: dict[str, str]) -> str:
    """The reason no transport is left: both endpoints, and per allowed transport why not."""
    tried = [f"{t}: {refused[t] if t in refused else why_not(t, sender, receiver)}" for t in allowed]
    return (f"no weight transport reaches the sampler: trainer on {sender.describe()}, sampler on "
            f"{receiver.describe()}; " + "; ".join(tried))


def explain(transport: str, sender: Endpoint, receiver: Endpoint) -> str:
    """How the pair stands, for the log line of a link: "same host vm, cpu → cpu"."""
    where = (f"same host {sender.host.split('/')[0]}" if sender.host == receiver.host
             else f"hosts {sender.host.split('/')[0]} and {receiver.host.split('/')[0] or '?'}")
    return f"{transport} ({where}, {short_device(sender.device)} → {short_device(receiver.device)})"


def short_device(device: str) -> str:
    return device[:13] if device.startswith("cuda:") else device or "?"
