"""Waiting for a snapshot's persisted copy that the trainer writes after its push replied: the
reader sees the whole copy or waits, learns at once of a failed write, and gets a retryable
error when the wait runs out."""

import os
import threading
import time

import grpc
import pytest

from tinkerd import persisted_copy


def test_a_reader_waits_for_the_rename_and_never_sees_a_partial_copy(tmp_path):
    path = str(tmp_path / "snapshots" / "s@1")
    partial = path + ".partial-1"
    os.makedirs(partial)
    (tmp_path / "snapshots" / "s@1.partial-1" / "adapter_model.safetensors").write_bytes(b"x" * 10)

    def finish():
        time.sleep(0.2)
        with open(os.path.join(partial, "adapter_config.json"), "w") as f:
            f.write("{}")
        os.replace(partial, path)
    threading.Thread(target=finish).start()
    assert not persisted_copy.is_complete(path)
    t0 = time.monotonic()
    persisted_copy.wait_for(path, timeout_s=10)
    assert 0.15 < time.monotonic() - t0 < 5 and persisted_copy.is_complete(path)
    persisted_copy.wait_for(path, timeout_s=0)           # complete: no wait at all


def test_a_failed_write_ends_the_wait_at_once_and_a_missing_copy_is_retryable(tmp_path):
    path = str(tmp_path / "s@2")
    persisted_copy.record_failure(path, OSError(28, "No space left on device"))
    t0 = time.monotonic()
    with pytest.raises(persisted_copy.CopyFailedError, match="No space left on device"):
        persisted_copy.wait_for(path, timeout_s=30)
    assert time.monotonic() - t0 < 1

    with pytest.raises(persisted_copy.CopyNotReadyError, match="retry") as late:
        persisted_copy.wait_for(str(tmp_path / "s@3"), timeout_s=0.1)
    # Not UNAVAILABLE: the gateway reads that as "this replica is down" and fails over.
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
