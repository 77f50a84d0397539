"""One `tinkerd up`, and one trainer, per state dir.

A second stack started on a state dir in use (a second terminal, a restart while the first still
runs, the services an earlier `up` left behind when it was killed) would share the first's database,
checkpoints and models' durable state, and the two trainers would overwrite each other's. So each
holds an advisory lock on `<state-dir>/<name>.lock` for its life, and one that finds it held refuses
to start, naming the holder. The kernel drops the lock when its process dies, SIGKILL included, so
a stopped or crashed stack never leaves a stale lock behind. Gateways and samplers take none:
several share a state dir by design (docs/deployment.md).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from tinkerd.errors import StateDirError

log = logging.getLogger(__name__)

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)      # a file system without flock
_held: dict[str, int] = {}          # lock file path -> its open descriptor, kept for the process's life


class StateDirInUse(StateDirError):
    pass


def make_state_dir(path: str) -> None:
    """`path` made 0700 if missing (an existing one keeps its mode); StateDirError if it cannot be."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise StateDirError(f"cannot make the state dir {path}: {e.strerror} (--state-dir: a directory this "
                            f"user may create and write in)") from None


def hold(state_dir: str, name: str, holder: str) -> None:
    """Locks `<state_dir>/<name>.lock` for the rest of this process, recording `holder` (who we
    are, for the message another process gets); raises StateDirInUse if another process holds it.
    A file system without locks (some network mounts) is logged and let be."""
    path = _path(state_dir, name)
    if path in _held:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise StateDirError(f"cannot write in the state dir {os.path.dirname(path)}: {e.strerror} (--state-dir: "
                            f"a directory this user may create and write in)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateDirInUse(_in_use(state_dir, name, path)) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in _NO_LOCKS:
            raise
        log.warning("%s: this file system has no locks (%s); nothing stops a second %s on %s", path,
                    e.strerror, name, state_dir)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"{holder} (pid {os.getpid()})".encode())
    _held[path] = fd


def check_free(state_dir: str, name: str) -> None:
    """Raises StateDirInUse if another process holds `<state_dir>/<name>.lock` now (a look: the
    lock is not kept). For a launcher, before it starts the process that will take it."""
    path = _path(state_dir, name)
    if path in _held or not os.path.exists(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StateDirInUse(_in_use(state_dir, name, path)) from None
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
    finally:
        os.close(fd)


def release(state_dir: str, name: str) -> None:
    """Gives the lock up before this process ends (tests)."""
    fd = _held.pop(_path(state_dir, name), None)
    if fd is not None:
        os.close(fd)


def _path(state_dir: str, name: str) -> str:
    return os.path.join(os.path.abspath(state_dir), f"{name}.lock")


def _in_use(state_dir: str, name: str, path: str) -> str:
    try:
        with open(path) as f:
            holder = f.read().strip() or f"another process ({path})"
    except OSError:
        holder = f"another process ({path})"
    two = {"up": "two stacks", "trainer": "two trainers"}.get(name, f"two of {name}")
    return (f"the state dir {os.path.abspath(state_dir)} is in use by {holder}: {two} on one state dir would share "
            f"its checkpoints and models' durable state and overwrite each other's. Stop that one first, or give "
            f"this one another --state-dir")
