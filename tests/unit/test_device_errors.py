"""A device error that poisons the CUDA context (a device-side assert, an illegal memory access)
breaks the trainer job as a lost rank does: the call fails as UNAVAILABLE (the gateway re-drives
others' work), health turns NOT_SERVING, and the process exits for its supervisor to restart it.
An error a tenant's input causes on CPU, or running out of memory, is not one: it stays that
request's error. (No GPU here: the errors are raised as PyTorch raises them.)"""

from __future__ import annotations

import threading
import time

import pytest

from tinkerd.errors import UnavailableError
from trainer_service import ranks as ranks_module
from trainer_service.ranks import Ranks, collective, device_broken


class _Engine:
    def __init__(self, error: BaseException):
        self._lock = threading.RLock()
        self.ranks = Ranks(self._lock)
        self.error = error

    @collective
    def forward_backward(self, model_id: str):
        raise self.error


@pytest.fixture
def exits(monkeypatch):
    exited = threading.Event()
    monkeypatch.setattr(ranks_module, "EXIT_AFTER_S", 0.01)
    monkeypatch.setattr(ranks_module, "exit_now", lambda code: exited.set())
    return exited


def test_a_device_side_assert_breaks_the_job_and_the_process_exits(exits):
    engine = _Engine(RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA"))
    told = []
    engine.ranks.on_broken.append(told.append)
    with pytest.raises(UnavailableError, match="device error in forward_backward"):
        engine.forward_backward("m")
    assert engine.ranks.broken and told == [engine.ranks.broken]       # health reads NOT_SERVING
    assert exits.wait(5)
    with pytest.raises(UnavailableError, match="is broken"):           # nothing more runs meanwhile
        engine.ranks.lead("forward_backward", lambda: None)


@pytest.mark.parametrize("error", [IndexError("index 9 is out of bounds for dimension 0 with size 4"),
                                   RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   ValueError("shapes do not match")])
def test_a_request_error_stays_that_requests(exits, error):
    engine = _Engine(error)
    with pytest.raises(type(error)):
        engine.forward_backward("m")
    time.sleep(0.05)
    assert engine.ranks.broken is None and not exits.is_set()
    assert not device_broken(error)
