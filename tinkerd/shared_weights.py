"""Snapshot chunks through memory both ends map, for a trainer and a sampler on one host: a
/dev/shm file ("shm") or a CUDA buffer opened through a CUDA IPC handle ("cuda_ipc").

The trainer owns one buffer per sampler link and reuses it push after push (touching fresh pages
costs more than the copy, weight_stream.touched); a larger snapshot gets a new, larger one. It
fills the buffer with the chunks back to back, sends the handle in the manifest and waits for
the reply: the sampler copies the bytes out before replying (vLLM keeps views of what it is
given, and the buffer is refilled by the next push), so only then is the buffer free again.

A /dev/shm file is created 0600 under a random name (another user cannot open it; the sampler
runs as the trainer's user or refuses). The sampler keeps its mapping of the file across pushes,
so the trainer unlinks the name once the sampler has mapped it: from then on nothing is left
in /dev/shm when either process dies, and the memory goes with the last mapping. A CUDA IPC
handle is opened anew per push (about 1 ms) and closed once the bytes are copied.
"""

from __future__ import annotations

import os
import pickle
import secrets

import torch

SHM_DIR = "/dev/shm"
PREFIX = "tinkerd-weights-"


class Region:
    """The trainer's /dev/shm file for one link, mapped; `fresh` until the sampler has mapped it."""

    def __init__(self, num_bytes: int):
        self.path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, num_bytes)
            self.buffer = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=num_bytes, dtype=torch.uint8)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)              # the mapping keeps the memory
        self.buffer.zero_()           # fault every page in now, not on the first push
        self.fresh = True

    def unlink(self) -> None:
        """Removes the name (the mappings stay valid); again is harmless."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def fill(buffer: torch.Tensor, chunks: list[torch.Tensor]) -> int:
    """Copies the chunks into `buffer` back to back; returns their total size."""
    position = 0
    for chunk in chunks:
        buffer[position:position + chunk.numel()].copy_(chunk)
        position += chunk.numel()
    return position


def map_region(path: str, num_bytes: int) -> torch.Tensor:
    """The sampler's mapping of a trainer's Region. Raises OSError (a file it cannot see or open:
    another /dev/shm, another user) or ValueError (not a region, or shorter than `num_bytes`:
    reading past a file's end would be a SIGBUS, not an error)."""
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        raise ValueError(f"{path!r} is not a weight region under {SHM_DIR}")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size < num_bytes:
            raise ValueError(f"{path} holds {size} bytes, fewer than the {num_bytes} announced")
        # Through the descriptor: the file checked is the file mapped.
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
    finally:
        os.close(fd)


def cuda_handle(buffer: torch.Tensor) -> bytes:
    """A CUDA tensor's IPC handle, pickled (a few hundred bytes): the arguments of
    torch.multiprocessing's rebuild_cuda_tensor. The caller keeps `buffer` alive and unchanged
    until the receiver has copied it."""
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(buffer.device).synchronize()    # the fill is done before anyone reads
    _, args = reduce_tensor(buffer)
    return pickle.dumps(args)


# rebuild_cuda_tensor's argument that names the device: the sender's index, not necessarily ours.
_DEVICE_ARG = 6


def open_cuda_handle(handle: bytes, device_index: int) -> torch.Tensor:
    """The sender's CUDA buffer, opened on this process's `device_index` (its index of the
    sender's device: CUDA_VISIBLE_DEVICES may number it differently here). Drop the result once
    copied: that closes the handle."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(_HandleUnpickler(handle).load())
    args[_DEVICE_ARG] = device_index
    return rebuild_cuda_tensor(*args)


class _HandleUnpickler(pickle.Unpickler):
    """Unpickles a handle's arguments and nothing else: only the classes and dtypes they name
    resolve, so a manifest cannot make the sampler call anything."""

    ALLOWED = {("torch", "Tensor"), ("torch._tensor", "Tensor"), ("torch", "Size"),
               ("torch.storage", "TypedStorage"), ("torch", "TypedStorage"),
               ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage")}

    def __init__(self, data: bytes):
        import io

        super().__init__(io.BytesIO(data))

    def find_class(self, module: str, name: str):
        found = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in self.ALLOWED or isinstance(found, torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a CUDA handle does not name {module}.{name}")
