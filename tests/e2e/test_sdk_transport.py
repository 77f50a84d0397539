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


def test_a_client_on_this_host_is_told_not_to_compress_forward_backward(stack, tiny_model_dir):
    """--fwdbwd-compression auto: zstd costs CPU at both ends and saves no network on loopback
    (tests/gateway/test_client_config.py for the other cases; test_balanced_gateways runs `on`)."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=stack.url)
    assert service.holder.get_client_config().proto_compress_fwdbwd is False
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4)
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4})
    assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
