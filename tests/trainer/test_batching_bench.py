"""bench/batching.py's prototype as its own command (`python -m bench.batching`, what a GPU host
without vLLM runs): K tenants' rows in one pass with per-row LoRA, against a pass per tenant, on a
device and dtype of choice; each tenant's gradients must be its own pass's."""

import re

import pytest


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_prototype_command_times_one_pass_against_a_pass_per_tenant(capsys, dtype):
    from bench.batching import main

    main(["--device", "cpu", "--shape", "tiny", "--dtype", dtype, "--batch", "1", "--length", "32",
          "--tenants", "2", "--rounds", "1"])
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("|")]
    assert "2 tenants x 1x32 tokens" in line
    gain = float(re.search(r"\| x([0-9.]+) \|", line).group(1))
    worst = float(re.search(r"within ([0-9.e+-]+) of their largest", line).group(1))
    assert gain > 0 and worst <= (1e-5 if dtype == "float32" else 1e-2), line     # summation order; bf16 rounding
