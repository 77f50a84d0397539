"""Every Tinker endpoint the SDK can reach, driven through whatever `tinker` release runs this
script (tests/e2e/test_sdk_endpoints.py runs it with 0.38.0 and, in their own venvs, older ones).

Prints `OK <step>` per step, and `SKIP <step>: <why>` where this SDK release has no such call.
Exits non-zero on the first failure. Usage: sdk_probe.py <base_url> <base_model>
"""
import inspect
import math
import os
import sys
import time
import urllib.error
import urllib.request

os.environ.setdefault("TINKER_API_KEY", "tml-probe")
os.environ.setdefault("TINKER_PROJECT_ID", "probe-project")
import tinker  # noqa: E402
from tinker import types  # noqa: E402

url, base = sys.argv[1], sys.argv[2]
LOSSES = set(__import__("typing").get_args(types.LossFnType))


def res(x):
    """Older releases return values where newer ones return futures (or the reverse)."""
    return x.result() if hasattr(x, "result") else x


def ok(step, detail=""):
    print(f"OK {step} {detail}".rstrip(), flush=True)


def skip(step, why):
    print(f"SKIP {step}: {why}", flush=True)


def fails(step, fn, *needles):
    """`fn` must raise an error that names the problem (a user error), not hang or crash."""
    try:
        res(fn())
    except Exception as e:  # noqa: BLE001 - the SDK's error classes differ across releases
        text = f"{type(e).__name__}: {e}"
        assert any(n in text for n in needles), f"{step}: unexpected error {text}"
        assert "user" in str(getattr(e, "category", "user")).lower(), text
        ok(step, f"-> {text[:100]}")
        return
    raise AssertionError(f"{step}: no error")


sc = tinker.ServiceClient(base_url=url)
caps = res(sc.get_server_capabilities())
assert base in [m.model_name for m in caps.supported_models], caps
ok("get_server_capabilities")

tc = res(sc.create_lora_training_client(base_model=base, rank=4))
info = res(tc.get_info())
assert info.model_data.model_name == base, info
ok("create_model + get_info", tc.model_id if hasattr(tc, "model_id") else "")

prompt = [5, 6, 7, 8, 9, 10]
sft = types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                  loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * 5})
fwd = res(tc.forward([sft], "cross_entropy"))
lp = fwd.loss_fn_outputs[0]["logprobs"].tolist()
assert len(lp) == 5 and abs(sum(lp) + fwd.metrics["loss:sum"]) < 1e-3, (lp, fwd.metrics)
ok("forward", fwd.metrics)

for _ in range(4):
    fb = res(tc.forward_backward([sft], "cross_entropy"))
    res(tc.optim_step(types.AdamParams(learning_rate=2e-3)))
after = res(tc.forward([sft], "cross_entropy")).metrics["loss:sum"]
assert after < fwd.metrics["loss:sum"], (after, fwd.metrics)
ok("forward_backward + optim_step (cross_entropy)", f"loss:sum {fwd.metrics['loss:sum']:.3f} -> {after:.3f}")

rl = types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                 loss_fn_inputs={"target_tokens": prompt[1:], "logprobs": [-2.0] * 5, "advantages": [1.0] * 5})
configs = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, "dro": {"beta": 0.1}}
for loss in ("importance_sampling", "ppo", "cispo", "dro", "gspo"):
    if loss not in LOSSES:
        skip(f"forward_backward ({loss})", "not a loss name in this SDK")
        continue
    out = res(tc.forward_backward([rl], loss, loss_fn_config=configs.get(loss)))
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 5
    ok(f"forward_backward ({loss})", out.metrics)
res(tc.optim_step(types.AdamParams(learning_rate=1e-3)))

import torch  # noqa: E402 - the custom loss runs on the client


def custom_loss(data, logprobs_list):
    loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum() for d, lp in zip(data, logprobs_list))
    return loss, {"custom_loss": float(loss)}


out = res(tc.forward_backward_custom([sft], custom_loss))
assert math.isfinite(out.metrics["custom_loss"]), out.metrics
ok("forward_backward_custom", out.metrics)

fails("bad input: missing advantages", lambda: tc.forward_backward([sft], "importance_sampling"), "advantages")
fails("bad input: unknown loss name", lambda: tc.forward_backward([sft], "no_such_loss"), "no_such_loss")
fails("bad input: targets of the wrong length", lambda: tc.forward_backward([types.Datum(
    model_input=types.ModelInput.from_ints(prompt), loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})],
    "cross_entropy"), "target", "length", "shape")

# ---- sampling ----
sampler = res(tc.save_weights_and_get_sampling_client())
ids = types.ModelInput.from_ints(prompt)
r = res(sampler.sample(ids, 2, types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)))
assert len(r.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) <= 4 for s in r.sequences), r
ok("save_weights_and_get_sampling_client + sample", [s.tokens for s in r.sequences])
r = res(sampler.sample(ids, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])))
assert len(r.sequences[0].tokens) == 6 and r.sequences[0].stop_reason == "length", r
first = r.sequences[0].tokens[0]
r = res(sampler.sample(ids, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[first])))
assert r.sequences[0].stop_reason == "stop", r
ok("sample stop=[] / stop=[token id]")
r = res(sampler.sample(ids, 1, types.SamplingParams(max_tokens=2), include_prompt_logprobs=True,
                       topk_prompt_logprobs=2))
assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] is None, r.prompt_logprobs
assert all(len(k) == 2 for k in r.topk_prompt_logprobs[1:]), r.topk_prompt_logprobs
ok("sample with prompt logprobs + top-k")
if "topk_sample_logprobs" in inspect.signature(sampler.sample).parameters:
    r = res(sampler.sample(ids, 1, types.SamplingParams(max_tokens=3, stop=[]), topk_sample_logprobs=2))
    topk = r.sequences[0].topk_logprobs
    assert len(topk) == 3 and all(len(k) == 2 and k[0][1] >= k[1][1] for k in topk), topk
    ok("sample with top-k sample logprobs")
else:
    skip("sample with top-k sample logprobs", "no topk_sample_logprobs in this SDK")
if "prompt_logprobs_last_n" in inspect.signature(sampler.sample).parameters:
    r = res(sampler.sample(ids, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                           prompt_logprobs_last_n=2))
    assert r.prompt_logprobs[:-2] == [None] * (len(prompt) - 2) and None not in r.prompt_logprobs[-2:], r
    ok("sample with prompt_logprobs_last_n")
else:
    skip("sample with prompt_logprobs_last_n", "not in this SDK")
clp = res(sampler.compute_logprobs(ids))
assert len(clp) == len(prompt) and clp[0] is None, clp
trainer_lp = res(tc.forward([sft], "cross_entropy")).loss_fn_outputs[0]["logprobs"].tolist()
assert max(abs(a - b) for a, b in zip(clp[1:], trainer_lp)) < 1e-3, (clp, trainer_lp)
ok("compute_logprobs equals the trainer's forward")

if "stable_reinforce" in LOSSES and hasattr(types.Datum, "with_provenance"):
    recorder = res(tc.save_weights_and_get_sampling_client(record_stability_info=True))
    seq = res(recorder.sample(ids, 1, types.SamplingParams(max_tokens=4, temperature=1.0, stop=[]))).sequences[0]
    full, n = prompt + list(seq.tokens), len(seq.tokens)

    def reinforce_datum(targets, sequence_id):
        d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": targets, "logprobs": [0.0] * (len(full) - 1),
                                        "advantages": [0.0] * (len(prompt) - 1) + [1.0] * n})
        return d.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=sequence_id, offset=0, length=len(prompt)),
                         types.SampledProvenanceSpan(sequence_id=sequence_id, offset=0, length=n - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=len(prompt) - 1),
                            types.SampledProvenanceSpan(sequence_id=sequence_id, offset=0, length=n)])

    out = res(tc.forward_backward([reinforce_datum(full[1:], seq.sequence_id)], "stable_reinforce"))
    assert math.isfinite(out.metrics["loss:sum"]), out.metrics
    ok("forward_backward (stable_reinforce) over recorded samples", out.metrics)
    wrong = full[1:-1] + [(full[-1] + 1) % 100]
    fails("stable_reinforce: targets that are not the sampled tokens",
          lambda: tc.forward_backward([reinforce_datum(wrong, seq.sequence_id)], "stable_reinforce"), "not the tokens")
    fails("stable_reinforce: a sequence never recorded",
          lambda: tc.forward_backward([reinforce_datum(full[1:], "nope:0")], "stable_reinforce"), "no stability record")
else:
    skip("forward_backward (stable_reinforce)", "no stable_reinforce / provenance in this SDK")

named = res(tc.save_weights_for_sampler("probe-sampler")).path
assert named.endswith("/sampler_weights/probe-sampler"), named
from_path = res(sc.create_sampling_client(model_path=named))
assert max(abs(a - b) for a, b in zip(res(from_path.compute_logprobs(ids))[1:], clp[1:])) < 1e-4
r = res(from_path.sample(ids, 1, types.SamplingParams(max_tokens=3, temperature=0.0)))
ok("save_weights_for_sampler (named) + create_sampling_client(model_path)", named)

base_sampler = res(sc.create_sampling_client(base_model=base))
res(base_sampler.sample(ids, 1, types.SamplingParams(max_tokens=2)))
ok("create_sampling_client(base_model)")

# ---- state ----
state = res(tc.save_state("probe-state")).path
assert state.endswith("/weights/probe-state"), state
ok("save_state", state)
fails("save_state to an existing name", lambda: tc.save_state("probe-state"), "exists")
for make in ("create_training_client_from_state", "create_training_client_from_state_with_optimizer"):
    t0 = time.monotonic()
    c = res(getattr(sc, make)(state))
    moved = res(c.forward([sft], "cross_entropy")).loss_fn_outputs[0]["logprobs"].tolist()
    # Releases before 0.31 load into a model made first (load_weights at seq_id 1): its next
    # request once waited out the trainer's 10 s gap timeout for that seq_id.
    assert time.monotonic() - t0 < 8, f"{make} and a forward took {time.monotonic() - t0:.1f} s"
    assert max(abs(a - b) for a, b in zip(moved, trainer_lp)) < 1e-4, (moved, trainer_lp)
    ok(make, c.model_id if hasattr(c, "model_id") else "")
res(c.load_state(state))
ok("load_state (legacy, into an existing model)")

models_resource = __import__("tinker.resources.models", fromlist=["AsyncModelsResource"]).AsyncModelsResource
if hasattr(models_resource, "unload"):
    # unload_model, as SDKs up to 0.25 send it (their low-level client; nothing in them calls it):
    # the model's memory is freed and it loads again, unchanged, on its next request.
    import time

    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

    async def unload(model_id):
        with tc.holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            future = await client.models.unload(request=types.UnloadModelRequest(model_id=model_id))
        return await _APIFuture(types.UnloadModelResponse, tc.holder, future, request_start_time=time.time(),
                                request_type="UnloadModel").result_async()

    assert tc.holder.run_coroutine_threadsafe(unload(tc.model_id)).result().model_id == tc.model_id
    reloaded = res(tc.forward([sft], "cross_entropy")).loss_fn_outputs[0]["logprobs"].tolist()
    assert max(abs(a - b) for a, b in zip(reloaded, trainer_lp)) < 1e-4, (reloaded, trainer_lp)
    fails("unload_model of an unknown model", lambda: tc.holder.run_coroutine_threadsafe(
        unload(tc.model_id + "-missing")).result(), "unknown model_id")
    ok("unload_model, then the model reloads unchanged")
else:
    skip("unload_model", "not in this SDK")
fails("load an unknown checkpoint", lambda: sc.create_training_client_from_state(state + "-missing"), "unknown")
fails("load a sampler path as state", lambda: sc.create_training_client_from_state(named),
      "not a training checkpoint")

# ---- REST registry ----
rest = tinker.RestClient(base_url=url) if hasattr(tinker, "RestClient") else sc.create_rest_client()
run_id = state.split("/")[2]
runs = res(rest.list_training_runs(limit=100)).training_runs
assert run_id in [r.training_run_id for r in runs], runs
run = res(rest.get_training_run(run_id))
assert run.base_model == base and run.last_checkpoint is not None, run
assert res(rest.get_training_run_by_tinker_path(state)).training_run_id == run_id
ok("training_runs list / get / by path")
ckpts = {c.tinker_path for c in res(rest.list_checkpoints(run_id)).checkpoints}
assert {state, named} <= ckpts, ckpts
assert state in {c.tinker_path for c in res(rest.list_user_checkpoints()).checkpoints}
ok("checkpoints list per run / all")
w = res(rest.get_weights_info_by_tinker_path(state))
assert w.base_model == base and w.lora_rank == 4, w
ok("weights_info")
res(rest.publish_checkpoint_from_tinker_path(state))
assert [c.public for c in res(rest.list_checkpoints(run_id)).checkpoints if c.tinker_path == state] == [True]
res(rest.unpublish_checkpoint_from_tinker_path(state))
ok("publish / unpublish")
res(rest.set_checkpoint_ttl_from_tinker_path(state, 3600))
expiry = [c.expires_at for c in res(rest.list_checkpoints(run_id)).checkpoints if c.tinker_path == state]
assert len(expiry) == 1 and expiry[0] is not None, expiry
ok("checkpoint ttl")
session_id = run_id.split(":")[0]
assert run_id in res(rest.get_session(session_id)).training_run_ids
assert session_id in res(rest.list_sessions(limit=1000)).sessions
ok("sessions get / list")
sampler_id = getattr(from_path, "_sampling_session_id", None)
if sampler_id and hasattr(rest, "get_sampler"):
    assert res(rest.get_sampler(sampler_id)).base_model == base
    ok("get_sampler")

if hasattr(tc, "save_weights_external"):
    ext = res(tc.save_weights_external("probe-external")).path
    urls = res(rest.get_external_weights_urls(ext)).urls
    assert any(f.endswith("adapter_model.safetensors") for f in urls), urls
    with urllib.request.urlopen(next(iter(urls.values()))) as f:
        assert f.status == 200 and f.read()
    ok("save_weights_external + external_weights_urls + file download")
else:
    skip("save_weights_external", "not in this SDK")

if hasattr(sc, "copy_weights"):
    copied = res(sc.copy_weights(named))
    assert copied.endswith("/sampler_weights/probe-sampler") and copied != named, copied
    assert res(rest.get_weights_info_by_tinker_path(copied)).base_model == base
    copy_sampler = res(sc.create_sampling_client(model_path=copied))
    assert max(abs(a - b) for a, b in zip(res(copy_sampler.compute_logprobs(ids))[1:], clp[1:])) < 1e-4
    copied_state = res(sc.copy_weights(state))
    c = res(sc.create_training_client_from_state(copied_state))
    copy_lp = res(c.forward([sft], "cross_entropy")).loss_fn_outputs[0]["logprobs"].tolist()
    assert max(abs(a - b) for a, b in zip(copy_lp, trainer_lp)) < 1e-4
    ok("copy_weights (sampler and state) then open the copies", copied)
else:
    skip("copy_weights", "not in this SDK")

if hasattr(rest, "get_checkpoint_archive_url_from_tinker_path"):
    # SDKs up to 0.35: a signed URL of the checkpoint as a tar, which their CLI downloads and checks.
    import io
    import subprocess
    import tarfile
    import tempfile

    for path in (state, named):
        archive = res(rest.get_checkpoint_archive_url_from_tinker_path(path))
        with urllib.request.urlopen(archive.url) as f:
            names = tarfile.open(fileobj=io.BytesIO(f.read())).getnames()
        assert {"adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"} <= set(names), names
    with tempfile.TemporaryDirectory() as out:
        cli = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "download", state, "-o", out],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "TINKER_BASE_URL": url})
        assert cli.returncode == 0, cli.stdout + cli.stderr
        got = {f for _, _, files in os.walk(out) for f in files}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= got, (got, cli.stdout)
    bad = urllib.request.Request(archive.url.replace("signature=", "signature=0"))
    try:
        urllib.request.urlopen(bad)
        raise AssertionError("a forged archive link was served")
    except urllib.error.HTTPError as e:
        assert e.code == 404, e
    ok("checkpoint archive URL + download (and `tinker checkpoint download`)")
else:
    skip("checkpoint archive", "no get_checkpoint_archive_url in this SDK")

res(rest.delete_checkpoint_from_tinker_path(named))
assert named not in {c.tinker_path for c in res(rest.list_checkpoints(run_id)).checkpoints}
fails("open a deleted checkpoint", lambda: res(sc.create_sampling_client(model_path=named)).sample(
    ids, 1, types.SamplingParams(max_tokens=2)), "unknown")
ok("delete checkpoint")

if hasattr(sc, "close"):
    res(sc.close("success") if "status" in inspect.signature(sc.close).parameters else sc.close())
    fails("train after ServiceClient.close", lambda: tc.forward([sft], "cross_entropy"), "closed")
    # What the server says to a client that keeps using a closed session (the SDK may stop first).
    import json

    def post(path, body):
        req = urllib.request.Request(f"{url}/api/v1/{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "X-API-Key": os.environ["TINKER_API_KEY"]})
        try:
            with urllib.request.urlopen(req) as f:
                return f.status, f.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
    status, text = post("optim_step", {"model_id": run_id, "seq_id": 999, "adam_params": {"learning_rate": 1e-3}})
    assert status == 400 and "closed" in text and '"user"' in text, (status, text)
    assert post("session_heartbeat", {"session_id": session_id})[0] == 410
    ok("a closed session's model and heartbeat are refused (400 user / 410)")
    again = tinker.ServiceClient(base_url=url)
    c = res(again.create_training_client_from_state(state))
    res(c.forward([sft], "cross_entropy"))
    ok("close (sessions/finish); a new ServiceClient loads the closed run's checkpoint")
else:
    skip("close", "no ServiceClient.close in this SDK")
print("ALL DONE", tinker.__version__, flush=True)
