"""Which transport the unmodified SDK 0.38 runs on against `tinkerd up` (client/config's
use_pyqwest_transport, gateway/routes/service.py). On CPython before 3.14 a pyqwest (tokio) thread
that hands the SDK's last answer to its event loop as the script exits is ended by the finalizing
interpreter through Rust frames, and the process aborts (exit 134) after its work is done: CI saw
it in SDK 0.35's whoami and SDK 0.38's `tinker billing`, and a loop of whoami calls under load
aborted 12 of 100 times. So such a client trains and samples on httpx and never loads pyqwest; a
client on CPython 3.14 (named by the SDK's X-Stainless-Runtime-Version header) gets pyqwest."""

from __future__ import annotations

import pytest

from sdk_transport_run import sdk_run

pytestmark = pytest.mark.e2e


def test_the_sdk_before_cpython_3_14_runs_on_httpx_and_on_3_14_on_pyqwest(stack, tiny_model_dir):
    assert sdk_run(stack.url, tiny_model_dir) is False
    assert sdk_run(stack.url, tiny_model_dir, "3.14") is True
