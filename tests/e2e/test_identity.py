"""Identity end to end, through the unmodified SDK against `tinkerd up`: two users with their own
keys (made with `tinkerd keys create` while the stack runs) train and sample at once, each sees
only their own work and gets 404 for the other's, a published checkpoint opens to both; unknown
and revoked keys get AuthenticationError; whoami on SDK 0.38 and 0.35; the audit log."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest
import tinker
from sdk_venvs import sdk_python
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e


def _keys(stack, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "keys", *args, "--state-dir", stack.state_dir],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def users(stack):
    return {name: _keys(stack, "create", "--user", name, "--email", f"{name}@example.com")
            for name in ("alice", "bob")}


def _train_and_sample(url: str, key: str, base: str, text: str, out: dict) -> None:
    """One user's whole loop: train two steps, save a sampler checkpoint and a state, sample."""
    service = tinker.ServiceClient(base_url=url, api_key=key)
    tc = service.create_lora_training_client(base_model=base, rank=4, seed=0)
    data = sft_data(tc.get_tokenizer(), [text])
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    out["run"] = tc.model_id
    out["state"] = tc.save_state("step2").result().path
    out["sampler"] = tc.save_weights_for_sampler("w2").result().path
    sampler = service.create_sampling_client(model_path=out["sampler"])
    seqs = sampler.sample(types.ModelInput.from_ints(data[0].model_input.to_ints()[:3]), num_samples=2,
                          sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0)).result().sequences
    out["sampled"] = [s.tokens for s in seqs]


def _refused(fn) -> str:
    """The SDK error a call ends in (it must end in one)."""
    with pytest.raises(Exception) as info:
        result = fn()
        if hasattr(result, "result"):
            result.result()
    return f"{type(info.value).__name__}: {info.value}"


def test_two_users_train_at_once_and_see_only_their_own(stack, users, tiny_model_dir):
    work = {name: {} for name in users}
    threads = [threading.Thread(target=_train_and_sample, args=(stack.url, users[name], tiny_model_dir,
                                                                f"{name} likes the red ball", work[name]))
               for name in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    alice, bob = work["alice"], work["bob"]
    assert len(alice["sampled"]) == 2 and len(bob["sampled"]) == 2, work
    bob_rest = tinker.RestClient(base_url=stack.url, api_key=users["bob"])
    assert [r.training_run_id for r in bob_rest.list_training_runs().result().training_runs] == [bob["run"]]
    assert {c.tinker_path for c in bob_rest.list_user_checkpoints().result().checkpoints} == {
        bob["state"], bob["sampler"]}
    for call in (lambda: bob_rest.get_training_run(alice["run"]),
                 lambda: bob_rest.list_checkpoints(alice["run"]),
                 lambda: bob_rest.delete_checkpoint_from_tinker_path(alice["state"]),
                 lambda: bob_rest.publish_checkpoint_from_tinker_path(alice["state"]),
                 lambda: bob_rest.get_weights_info_by_tinker_path(alice["state"])):
        assert "NotFound" in _refused(call) or "404" in _refused(call)
    bob_service = tinker.ServiceClient(base_url=stack.url, api_key=users["bob"])
    assert "unknown checkpoint" in _refused(lambda: bob_service.create_sampling_client(model_path=alice["sampler"]))
    assert "unknown checkpoint" in _refused(lambda: bob_service.create_training_client_from_state(alice["state"]))
    # Published, alice's checkpoints open to bob, who still cannot change them.
    alice_rest = tinker.RestClient(base_url=stack.url, api_key=users["alice"])
    alice_rest.publish_checkpoint_from_tinker_path(alice["state"]).result()
    alice_rest.publish_checkpoint_from_tinker_path(alice["sampler"]).result()
    resumed = bob_service.create_training_client_from_state(alice["state"])
    assert resumed.model_id != alice["run"] and resumed.get_info().lora_rank == 4
    sampler = bob_service.create_sampling_client(model_path=alice["sampler"])
    assert sampler.sample(types.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=2)).result().sequences
    assert "NotFound" in _refused(lambda: bob_rest.delete_checkpoint_from_tinker_path(alice["state"]))
    assert alice["state"] in {c.tinker_path for c in alice_rest.list_user_checkpoints().result().checkpoints}


def test_unknown_and_revoked_keys_get_authentication_error(stack):
    unknown = _refused(lambda: tinker.ServiceClient(base_url=stack.url, api_key="tml-not-a-key").get_server_capabilities())
    assert "AuthenticationError" in unknown, unknown
    key = _keys(stack, "create", "--user", "carol")
    service = tinker.ServiceClient(base_url=stack.url, api_key=key)
    assert service.get_server_capabilities().supported_models
    _keys(stack, "revoke", key)
    time.sleep(2.5)                 # the gateway re-reads a key at most every 2 s
    revoked = _refused(lambda: tinker.ServiceClient(base_url=stack.url, api_key=key).get_server_capabilities())
    assert "AuthenticationError" in revoked, revoked


WHOAMI = """
import sys, tinker
if hasattr(tinker, "RestClient"):       # 0.36+: a RestClient needs no session
    rest = tinker.RestClient(base_url=sys.argv[1], api_key=sys.argv[2])
else:
    rest = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2]).create_rest_client()
me = rest.whoami().result()
print(tinker.__version__, me.user_urn, me.org_urn, me.email)
"""


@pytest.mark.parametrize("version", ["0.38.0", "0.35.0"])
def test_whoami_names_the_user(stack, users, version):
    out = subprocess.run([sdk_python(version, torch=False), "-c", WHOAMI, stack.url, users["alice"]],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sdk, urn, org, email = out.stdout.split()
    assert sdk == version and urn.startswith("tml:organization_user:user-")
    assert org == "tml:organization:default" and email == "alice@example.com"


def test_the_audit_log_lists_the_days_events_for_an_admin_only(stack, users):
    today = datetime.datetime.now(datetime.timezone.utc).date()
    entries = tinker.AdminClient(base_url=stack.url, api_key=stack.api_key).get_audit_log(day=today).result().entries
    events = {e.event for e in entries}
    assert {"api_key_created", "session_created", "training_run_created", "checkpoint_saved"} <= events, events
    assert all(e.timestamp.date() == today for e in entries)
    refused = _refused(lambda: tinker.AdminClient(base_url=stack.url, api_key=users["bob"]).get_audit_log())
    assert "PermissionDenied" in refused or "403" in refused, refused
