"""One `tinkerd up` and one trainer per state dir (tinkerd/state_lock.py): a second is refused
with the holder named, and a holder that died, even by SIGKILL, leaves nothing behind."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal

import pytest
from conftest import held_elsewhere

from tinkerd import state_lock


def test_a_second_holder_is_refused_naming_the_first_and_a_killed_ones_lock_is_free(tmp_path):
    with held_elsewhere(tmp_path, "trainer", "`tinkerd trainer` (--listen 127.0.0.1:0)") as holder:
        for attempt in (lambda: state_lock.hold(str(tmp_path), "trainer", "me"),
                        lambda: state_lock.check_free(str(tmp_path), "trainer")):
            with pytest.raises(state_lock.StateDirInUse) as refused:
                attempt()
            message = str(refused.value)
            assert f"in use by `tinkerd trainer` (--listen 127.0.0.1:0) (pid {holder.pid})" in message
            assert "two trainers" in message and "another --state-dir" in message
        state_lock.check_free(str(tmp_path), "up")          # another name's lock is another matter
        holder.send_signal(signal.SIGKILL)                  # no clean-up runs: the kernel drops the lock
        holder.wait(timeout=30)
        state_lock.hold(str(tmp_path), "trainer", "me")
    try:
        assert (tmp_path / "trainer.lock").read_text() == f"me (pid {os.getpid()})"
        assert (tmp_path / "trainer.lock").stat().st_mode & 0o077 == 0
        state_lock.hold(str(tmp_path), "trainer", "me")     # this process again: it holds it already
        state_lock.check_free(str(tmp_path), "trainer")
    finally:
        state_lock.release(str(tmp_path), "trainer")


def test_a_file_system_without_locks_is_logged_and_let_be(tmp_path, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="tinkerd.state_lock"):
        state_lock.hold(str(tmp_path), "trainer", "me")
        state_lock.check_free(str(tmp_path), "trainer")
    assert "has no locks" in caplog.text and "nothing stops a second trainer" in caplog.text
    state_lock.release(str(tmp_path), "trainer")


def test_a_state_dir_that_cannot_hold_the_lock_is_refused_saying_so(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(state_lock.StateDirError, match=f"cannot write in the state dir {tmp_path / 'a-file'}: "
                                                       "Not a directory"):
        state_lock.hold(str(tmp_path / "a-file"), "trainer", "me")
    with pytest.raises(state_lock.StateDirError, match="cannot make the state dir .*: Not a directory"):
        state_lock.make_state_dir(str(tmp_path / "a-file" / "state"))
