"""Which transport the unmodified SDK 0.38 runs on against `tinkerd up` (client/config's
use_pyqwest_transport, gateway/routes/service.py). On CPython before 3.14 a pyqwest (tokio) thread
that hands the SDK's last answer to its event loop as the script exits is ended by the finalizing
interpreter through Rust frames, and the process aborts (exit 134) after its work is done: CI saw
it in SDK 0.35's whoami and SDK 0.38's `tinker billing`, and a loop of whoami calls under load
aborted 12 of 100 times. So such a client trains and samples on httpx and never loads pyqwest; a
client on CPython 3.14 (named by the SDK's X-Stainless-Runtime-Version header) gets pyqwest."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

# One forward_backward and one sample, then which transport module the SDK loaded. With `claim` the SDK
# says it runs on CPython 3.14, and the script leaves by os._exit: this interpreter is 3.11, and
# pyqwest may abort it at the exit the test is not about.
SDK_RUN = """
import os, sys, tinker
from tinker import types
url, base_model, claim = sys.argv[1], sys.argv[2], sys.argv[3] == "3.14"
headers = {"X-Stainless-Runtime-Version": "3.14.0"} if claim else {}
service = tinker.ServiceClient(base_url=url, default_headers_overrides=headers)
tc = service.create_lora_training_client(base_model=base_model, rank=4, seed=0)
datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 1.0, 1.0]})
tc.forward_backward([datum], "cross_entropy").result()
sampler = service.create_sampling_client(base_model=base_model)
reply = sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=3)).result()
tokens = reply.sequences[0].tokens
print("pyqwest" in sys.modules, len(tokens), flush=True)
if claim:
    os._exit(0)
"""


def sdk_run(url: str, base_model: str, claim: str = "", env: dict | None = None) -> bool:
    """Runs SDK_RUN; whether the SDK loaded pyqwest."""
    out = subprocess.run([sys.executable, "-c", SDK_RUN, url, base_model, claim], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    loaded, sampled = out.stdout.split()[-2:]
    assert sampled == "3", out.stdout
    return loaded == "True"


def test_the_sdk_before_cpython_3_14_runs_on_httpx_and_on_3_14_on_pyqwest(stack, tiny_model_dir):
    assert sdk_run(stack.url, tiny_model_dir) is False
    assert sdk_run(stack.url, tiny_model_dir, "3.14") is True
