"""A snapshot's persisted PEFT copy, as its readers see it while the trainer may still write it.

The trainer writes an ephemeral snapshot's copy in the background, after every live replica
holds the snapshot in memory (trainer_service/weight_push.py), so a sampling session is usable
before its copy is on disk. The copy is a directory renamed into place whole, so it either
exists complete or not at all; a write that failed leaves `<path>.failed` with the reason.
Whoever needs the copy before it exists (a replica that missed the push or joined later) waits
for it here, for a bounded time, and then gets a retryable error, never a half-written file.
"""

from __future__ import annotations

import os
import time

import grpc

from tinkerd.errors import ServiceError

ADAPTER_CONFIG = "adapter_config.json"     # written last into the directory before its rename
FAILED_SUFFIX = ".failed"


class CopyFailedError(ServiceError):
    """The trainer could not write the copy (say, the disk is full): waiting longer won't help."""


class CopyNotReadyError(ServiceError):
    """Retryable: the copy was still being written when the wait ended. (Not UNAVAILABLE: to the
    gateway that means the replica is down, gateway/sampler_pool.py, and this one is fine.)"""
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def failed_marker(path: str) -> str:
    return path + FAILED_SUFFIX


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def record_failure(path: str, error: BaseException) -> None:
    """Leaves the reason next to where the copy would be, so readers stop waiting for it (best
    effort: a disk that failed the copy may fail this too, and then readers time out)."""
    try:
        with open(failed_marker(path), "w") as f:
            f.write(f"{type(error).__name__}: {error}"[:2000])
    except OSError:
        pass


def wait_for(path: str, timeout_s: float) -> None:
    """Returns once the copy at `path` is complete; raises CopyFailedError if its write failed,
    CopyNotReadyError (retryable) if it is still not there after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    while not is_complete(path):
        if os.path.exists(failed_marker(path)):
            with open(failed_marker(path)) as f:
                raise CopyFailedError(f"the persisted copy {path} could not be written: {f.read()}")
        if time.monotonic() >= deadline:
            raise CopyNotReadyError(f"the persisted copy {path} is still being written after {timeout_s:.0f} s; "
                                   f"retry shortly")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
