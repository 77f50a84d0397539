"""One SDK 0.38 run against a stack (a forward_backward and a sample), and which transport the
SDK loaded: httpx, or pyqwest where client/config told it to (gateway/routes/service.py).
tests/e2e/test_sdk_transport.py and tests/e2e/test_https.py run it."""

from __future__ import annotations

import subprocess
import sys

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
