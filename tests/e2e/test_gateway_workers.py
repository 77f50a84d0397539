"""`tinkerd up --gateway-workers 2`: two gateway processes share the public port (SO_REUSEPORT: the
kernel spreads the SDK's connections between them) and the SQLite database; what one finishes
wakes the other's waiters at once (gateway/futures/peers.py). The unmodified SDK trains, saves and
samples through the shared port; both processes answer its requests; every sample reaches it,
also after one process is killed with its samples in flight (`up` restarts it on its ports, the
other re-drives them once their lease lapses)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
import urllib.request

import psutil
import pytest

pytestmark = pytest.mark.e2e

CONCURRENT = 16
LONG = 256              # tokens: the samples still run when a gateway process is killed


def _gateways(stack) -> dict[str, int]:
    """{process name: pid} of the stack's gateway processes: the first listens internally on
    the stack's --internal-port."""
    first, found = stack.internal_url.rsplit(":", 1)[1], {}
    for child in psutil.Process(stack.pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
        if len(cmd) > 3 and cmd[3] == "gateway":
            found["gateway" if cmd[cmd.index("--internal-port") + 1] == first else "gateway-2"] = child.pid
    return found


def _metrics(stack) -> dict[str, str]:
    """Each gateway process's /metrics, by its name."""
    with open(os.path.join(stack.state_dir, "prometheus-targets.json")) as f:
        targets = [t for t in json.load(f) if t["labels"]["service"] == "gateway"]
    texts = {}
    for t in targets:
        with urllib.request.urlopen(f"http://{t['targets'][0]}/metrics", timeout=10) as r:
            texts[t["labels"]["process"]] = r.read().decode()
    return texts


def _answered(stack) -> dict[str, float]:
    """Each gateway process's retrieve_future(s) requests answered so far."""
    return {name: sum(float(m.group(1)) for m in re.finditer(
        r'^tinkerd_gateway_requests_total\{[^}]*route="/api/v1/retrieve_futures?"[^}]*\} (\S+)$', text, re.M))
        for name, text in _metrics(stack).items()}


def _samples_running(stack, name: str) -> float:
    m = re.search(r'^tinkerd_gateway_futures_pending\{type="sample"\} (\S+)$', _metrics(stack)[name], re.M)
    return float(m.group(1)) if m else 0.0


def _samples(sampler, prompt, params, n: int = CONCURRENT) -> list[list[int]]:
    futures = [sampler.sample(prompt, 1, params) for _ in range(n)]
    return [f.result(timeout=120).sequences[0].tokens for f in futures]


def test_two_gateway_processes_share_the_port_and_every_result_reaches_the_sdk(start_stack, tiny_model_dir, tmp_path):
    import tinker
    from tinker import types

    with start_stack(tiny_model_dir, tmp_path / "state", "--gateway-workers", "2", "--future-lease-s", "2") as stack:
        client = tinker.ServiceClient(base_url=stack.url)
        tc = client.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=1)
        prompt = tc.get_tokenizer().encode("the cat sat on the")
        datum = types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                            loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * (len(prompt) - 1)})
        losses = []
        for _ in range(3):
            fb = tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < losses[0], losses
        sampler = tc.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=4, temperature=0.0)
        greedy = _samples(sampler, types.ModelInput.from_ints(prompt), params)
        assert len(greedy) == CONCURRENT and all(t == greedy[0] and len(t) == 4 for t in greedy)
        path = tc.save_weights_for_sampler("w").result().path
        for _ in range(3):          # more clients, more connections: the kernel spreads them over both
            _samples(tinker.ServiceClient(base_url=stack.url).create_sampling_client(model_path=path),
                     types.ModelInput.from_ints(prompt), params)
        answered = _answered(stack)
        assert sorted(answered) == ["gateway", "gateway-2"] and all(n > 0 for n in answered.values()), answered

        # One process killed with samples in flight: every sample still reaches the SDK.
        pids = _gateways(stack)
        assert sorted(pids) == ["gateway", "gateway-2"], pids
        params = types.SamplingParams(max_tokens=LONG, temperature=0.0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            burst = pool.submit(_samples, sampler, types.ModelInput.from_ints(prompt), params)
            deadline = time.monotonic() + 60
            while not _samples_running(stack, "gateway-2"):
                assert time.monotonic() < deadline and not burst.done(), "no sample of the burst ran on gateway-2"
                time.sleep(0.01)
            os.kill(pids["gateway-2"], signal.SIGKILL)
            killed = time.monotonic()
            out = burst.result(timeout=180)
        print(f"the burst ended {time.monotonic() - killed:.1f} s after the kill")
        assert len(out) == CONCURRENT and all(t == out[0] and len(t) == LONG for t in out)
        # Those that ran on the killed process were re-driven once their lease lapsed (by the
        # other, or by the killed one restarted).
        logs = [os.path.join(stack.state_dir, "logs", f"{name}.log") for name in ("gateway", "gateway-2")]
        assert any("re-driving sample" in open(log).read() for log in logs)
        deadline = time.monotonic() + 120
        while (restarted := _gateways(stack)).get("gateway-2") in (None, pids["gateway-2"]):
            assert time.monotonic() < deadline, "gateway-2 was not restarted"
            time.sleep(0.2)
        assert restarted["gateway"] == pids["gateway"]
