"""SDK 0.38's management surface with the unmodified SDK and its `tinker` CLI against a real
`tinkerd up`, on SQLite and on PostgreSQL: projects and session search, usage for chargeback.

Each test acts as users of its own (keys made in the stack's database), so what they see is
what those users made."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import urllib.request
import uuid

import pytest
import tinker
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def mstack(request, tiny_model_dir, tmp_path_factory, start_stack):
    """A stack per database kind; (stack, db_url or None)."""
    if request.param == "sqlite":
        with start_stack(tiny_model_dir, tmp_path_factory.mktemp("state")) as s:
            yield s, None
        return
    pytest.importorskip("pgserver")
    from harness.postgres import postgres

    with postgres(tmp_path_factory.mktemp("pg"), "tinkerd") as url, \
            start_stack(tiny_model_dir, tmp_path_factory.mktemp("state"), "--db-url", url) as s:
        yield s, url


def new_user(mstack, name: str, **kwargs) -> str:
    """An API key of a new user `name` (unique per call) in the stack's database."""
    from launcher import keys

    stack, db_url = mstack
    return keys.new_key(keys.open_database(stack.state_dir, db_url), f"{name}-{uuid.uuid4().hex[:6]}", **kwargs)


def _session_of(tc) -> str:
    return tc.model_id.rsplit(":train:", 1)[0]


def test_projects_and_search_through_the_sdk(mstack, tiny_model_dir):
    stack, _ = mstack
    alice, bob = new_user(mstack, "alice"), new_user(mstack, "bob")
    rest = tinker.RestClient(base_url=stack.url, api_key=alice)
    nightly = tinker.ServiceClient(project_id="proj-nightly", display_name="Nightly SFT alpha",
                                   user_metadata={"team": "rl"}, base_url=stack.url, api_key=alice)
    tc = nightly.create_lora_training_client(base_model=tiny_model_dir, rank=4)
    session = _session_of(tc)
    plain = tinker.ServiceClient(base_url=stack.url, api_key=alice)
    other = _session_of(plain.create_lora_training_client(base_model=tiny_model_dir, rank=4))

    got = rest.get_session(session).result()
    assert got.display_name == "Nightly SFT alpha" and got.training_run_ids == [tc.model_id]
    page = rest.search_sessions(types.SessionSearchRequest(display_name="nightly")).result()
    assert [(s.session_id, s.project_id, s.display_name, s.user_metadata) for s in page.sessions] == [
        (session, "proj-nightly", "Nightly SFT alpha", {"team": "rl"})]
    assert isinstance(page.sessions[0].status, types.SessionActive)
    assert [s.session_id for s in rest.search_sessions(types.SessionSearchRequest()).result().sessions] == [
        other, session]
    by = {"metadata": types.SessionSearchRequest(user_metadata={"team": "rl"}),
          "id": types.SessionSearchRequest(session_id=other),
          "id or name": types.SessionSearchRequest(session_id=other, display_name="alpha nightly")}
    assert {k: [s.session_id for s in rest.search_sessions(r).result().sessions] for k, r in by.items()} == {
        "metadata": [session], "id": [other], "id or name": [other, session]}
    admin = tinker.RestClient(base_url=stack.url, api_key=stack.api_key)     # an admin of alice's org
    alice_urn = page.sessions[0].owner
    assert [s.session_id for s in admin.search_sessions(types.SessionSearchRequest(
        owner=types.UserSearchOwner(owner_urns=[alice_urn]))).result().sessions] == [other, session]
    with pytest.raises(tinker.BadRequestError, match="tml:organization_user:nobody"):
        admin.search_sessions(types.SessionSearchRequest(owner=types.UserSearchOwner(
            owner_urns=["tml:organization_user:nobody"]))).result()

    # Moving the session moves its run; bob can neither join the project nor see alice's sessions.
    rest.assign_session_project(session, "proj-moved").result()
    assert [r.training_run_id for r in rest.list_training_runs(project_id="proj-moved").result().training_runs] == [
        tc.model_id]
    with pytest.raises(tinker.PermissionDeniedError, match="proj-moved"):
        tinker.ServiceClient(project_id="proj-moved", base_url=stack.url,
                             api_key=bob).create_lora_training_client(base_model=tiny_model_dir, rank=4)
    bob_rest = tinker.RestClient(base_url=stack.url, api_key=bob)
    assert bob_rest.search_sessions(types.SessionSearchRequest(owner=types.AccessibleSearchOwner())).result() \
        .sessions == []
    with pytest.raises(tinker.BadRequestError, match="may list"):
        bob_rest.search_sessions(types.SessionSearchRequest(project_ids=["proj-moved"])).result()

    # Paging, newest first, and a finished session's status.
    plain.close("interrupted", "stopped by hand")
    request = types.SessionSearchRequest(limit=1)
    first = rest.search_sessions(request).result()
    second = rest.search_sessions(request.model_copy(update={"cursor": first.next_cursor})).result()
    assert [s.session_id for s in first.sessions + second.sessions] == [other, session]
    assert second.next_cursor is None
    finished = rest.search_sessions(types.SessionSearchRequest(statuses=[
        types.ClientFinishedSessionStatusQuery(reasons=["interrupted"])])).result().sessions
    assert [(s.session_id, s.status.reason.type, s.status.detail) for s in finished] == [
        (other, "interrupted", "stopped by hand")]
    with pytest.raises(tinker.BadRequestError, match="cursor"):
        rest.search_sessions(types.SessionSearchRequest(display_name="nothing like it",
                                                        cursor=first.next_cursor)).result()
    tc.forward_backward(sft_data(tc.get_tokenizer(), ["a session in a project trains"]), "cross_entropy").result()


def tinker_cli(stack, api_key: str, *argv: str) -> subprocess.CompletedProcess:
    """The SDK's own `tinker` command line, pointed at the stack."""
    env = {**os.environ, "TINKER_BASE_URL": stack.url, "TINKER_API_KEY": api_key, "TINKER_TELEMETRY": "0"}
    return subprocess.run([sys.executable, "-m", "tinker.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


def _disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files)


def _checkpoint_dirs(mstack, user_key: str) -> list[str]:
    from sqlalchemy import select

    from gateway.identity.keys import KeyStore
    from gateway.storage.db import CheckpointRow
    from launcher import keys

    stack, db_url = mstack
    db = keys.open_database(stack.state_dir, db_url)
    owner = KeyStore(db).caller_for_key(user_key).user_id
    return [r.directory for r in db.select(select(CheckpointRow).where(CheckpointRow.owner == owner))]


def _totals(events) -> dict:
    out: dict = {}
    for e in events:
        info = e.event_info
        value = {"storage": "gigabyte_hours", "checkpoint": "count"}.get(info.type, "token_count")
        out[info.type] = out.get(info.type, 0) + getattr(info, value)
    return out


def test_usage_equals_the_workload(mstack, tiny_model_dir):
    """SFT steps, samples and two checkpoints through the SDK: the usage report shows exactly the
    tokens trained, prefilled and sampled, and the checkpoints' bytes on disk, through
    AdminClient and `tinker billing`."""
    stack, _ = mstack
    key = new_user(mstack, "payer")
    started = datetime.datetime.now(datetime.timezone.utc).replace(minute=0, second=0, microsecond=0)
    service = tinker.ServiceClient(project_id="proj-bill", user_metadata={"cost_center": "42"},
                                   base_url=stack.url, api_key=key)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4)
    data = sft_data(tc.get_tokenizer(), ["usage is counted where the work happens", "tokens in, tokens out"])
    trained = 0
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        trained += sum(d.model_input.length for d in data)
    sampler = tc.save_weights_and_get_sampling_client()
    prompts = [tc.get_tokenizer().encode("count these"), tc.get_tokenizer().encode("and these too")]
    replies = [sampler.sample(types.ModelInput.from_ints(p), 2, types.SamplingParams(max_tokens=6)).result()
               for p in prompts]
    tc.save_state("bill-state").result()
    tc.save_weights_for_sampler("bill-sampler").result()

    end = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)).replace(
        minute=0, second=0, microsecond=0)
    usage = tinker.AdminClient(base_url=stack.url, api_key=key).get_billing_usage(started, end).result()
    totals = _totals(usage.data)
    assert totals["training"] == trained
    assert totals["sampling_prefill"] == sum(len(p) for p in prompts)
    assert totals["sampling_sample"] == sum(len(s.tokens) for r in replies for s in r.sequences)
    assert totals["checkpoint"] == 2
    session = _session_of(tc)
    assert {(e.session_id, e.project_id) for e in usage.data} == {(session, "proj-bill")}
    assert usage.sessions[session].user_metadata == {"cost_center": "42"}
    assert all(e.estimated_cost_usd is None for e in usage.data)

    on_disk = sum(_disk_bytes(d) for d in _checkpoint_dirs(mstack, key))
    current = tinker.AdminClient(base_url=stack.url, api_key=key).get_current_checkpoint_storage_usage().result()
    assert [(r.project_id, r.checkpoint_count, r.size_bytes) for r in current.data] == [("proj-bill", 2, on_disk)]
    hours = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 3600
    assert 0 < totals["storage"] <= on_disk / 1e9 * hours

    cli = tinker_cli(stack, key, "-f", "json", "billing", "usage", started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                     end.strftime("%Y-%m-%dT%H:%M:%SZ"))
    assert cli.returncode == 0, cli.stderr
    assert sum(r["event_info"]["token_count"] for r in json.loads(cli.stdout)["data"]
               if r["event_info"]["type"] == "training") == trained
    cli = tinker_cli(stack, key, "-f", "json", "billing", "checkpoint-storage", "--project-id", "proj-bill")
    assert cli.returncode == 0, cli.stderr
    assert [r["size_bytes"] for r in json.loads(cli.stdout)["data"]] == [on_disk]
    too_long = tinker_cli(stack, key, "billing", "usage", "2026-01-01T00:00:00Z", "2026-01-20T00:00:00Z")
    assert too_long.returncode != 0 and "14 days" in too_long.stderr + too_long.stdout

    # The gateway's Prometheus counters hold the same numbers (an admin's report covers every user).
    everyone = _totals(tinker.AdminClient(base_url=stack.url, api_key=stack.api_key)
                       .get_billing_usage(started - datetime.timedelta(hours=1), end).result().data)
    metrics = urllib.request.urlopen(f"{stack.internal_url}/metrics", timeout=30).read().decode()
    for kind in ("training", "sampling_prefill", "sampling_sample", "checkpoint"):
        line = next(x for x in metrics.splitlines() if x.startswith(f'tinkerd_gateway_usage_total{{kind="{kind}"}}'))
        assert float(line.split()[-1]) == everyone[kind], (kind, line)


def test_a_weights_access_token_through_the_sdk(mstack, tiny_model_dir):
    """The owner mints a token for one checkpoint; another user loads and copies it with
    weights_access_token; revoked, it grants nothing."""
    import httpx

    stack, db_url = mstack
    if db_url is not None:
        pytest.skip("a token is one row looked up by its id, the same SQL on either database; search and usage, "
                    "whose SQL differs, run on both above")
    owner, other = new_user(mstack, "owner"), new_user(mstack, "borrower")
    tc = tinker.ServiceClient(base_url=stack.url, api_key=owner).create_lora_training_client(
        base_model=tiny_model_dir, rank=4)
    tc.forward_backward(sft_data(tc.get_tokenizer(), ["lend me your weights"]), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("lent").result().path
    minted = httpx.post(f"{stack.url}/api/v1/weights_access_tokens", headers={"X-API-Key": owner},
                        json={"tinker_path": path, "ttl_seconds": 3600}, timeout=30).json()

    service = tinker.ServiceClient(base_url=stack.url, api_key=other)
    with pytest.raises(tinker.NotFoundError):
        service.create_training_client_from_state(path).result()
    loaded = service.create_training_client_from_state(path, weights_access_token=minted["token"]).result()
    datum = sft_data(tc.get_tokenizer(), ["lend me your weights"])
    assert loaded.forward(datum, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == \
        tc.forward(datum, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    rest = tinker.RestClient(base_url=stack.url, api_key=other)
    copied = rest.copy_weights(path, "proj-borrowed", weights_access_token=minted["token"]).result()
    assert copied in {c.tinker_path for c in rest.list_user_checkpoints(limit=100).result().checkpoints}

    httpx.delete(f"{stack.url}/api/v1/weights_access_tokens/{minted['token_id']}", headers={"X-API-Key": owner},
                 timeout=30).raise_for_status()
    with pytest.raises(tinker.PermissionDeniedError, match="revoked"):
        service.create_training_client_from_state(path, weights_access_token=minted["token"]).result()


def test_an_age_encrypted_export_decrypts_to_the_plain_one(mstack, tiny_model_dir, tmp_path):
    """save_weights_external with age_encryption_recipients: only .age files on disk, which
    `tinker checkpoint download` fetches and the matching identity decrypts to the very bytes of
    an unencrypted export of the same weights; a recipient that does not parse is a 400."""
    import pyrage

    stack, db_url = mstack
    if db_url is not None:
        pytest.skip("encryption happens in the trainer, whatever the database; search and usage run on both above")
    key = new_user(mstack, "sealer")
    identity = pyrage.x25519.Identity.generate()
    tc = tinker.ServiceClient(base_url=stack.url, api_key=key).create_lora_training_client(
        base_model=tiny_model_dir, rank=4)
    tc.forward_backward(sft_data(tc.get_tokenizer(), ["sealed weights"]), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    plain = tc.save_weights_external("plain").result().path
    sealed = tc.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())]).result().path
    rest = tinker.RestClient(base_url=stack.url, api_key=key)
    with pytest.raises(tinker.BadRequestError, match=r"age_encryption_recipients\[0\]"):
        tc.save_weights_external("broken", age_encryption_recipients=["age1notakey"]).result()
    assert not any(c.tinker_path.endswith("/broken") for c in rest.list_checkpoints(tc.model_id).result().checkpoints)

    sealed_dir = next(d for d in _checkpoint_dirs(mstack, key) if d.endswith("sealed"))
    assert sorted(os.listdir(sealed_dir)) == ["adapter_config.json.age", "adapter_model.safetensors.age",
                                              "tinkerd_state.json.age"]
    for path in (plain, sealed):
        got = tinker_cli(stack, key, "checkpoint", "download", path, "--output", str(tmp_path))
        assert got.returncode == 0, got.stdout + got.stderr
    plain_files = tmp_path / plain.replace("tinker://", "").replace("/", "_")
    sealed_files = tmp_path / sealed.replace("tinker://", "").replace("/", "_")
    assert sorted(p.name for p in sealed_files.iterdir()) == sorted(p.name + ".age" for p in plain_files.iterdir())
    for name in os.listdir(plain_files):
        decrypted = pyrage.decrypt((sealed_files / f"{name}.age").read_bytes(), [identity])
        assert decrypted == (plain_files / name).read_bytes(), name


def test_every_cli_command_a_self_hosted_server_serves(mstack, tiny_model_dir, tmp_path):
    """Each `tinker` subcommand of SDK 0.38 run against the stack (billing and checkpoint download
    are above); push-hf, which needs the Hugging Face Hub, ends with the CLI's own clear refusal."""
    stack, db_url = mstack
    if db_url is not None:
        pytest.skip("the CLI is the same over either database; billing's CLI runs on both above")
    key = new_user(mstack, "cli")
    tc = tinker.ServiceClient(base_url=stack.url, api_key=key, project_id="proj-cli").create_lora_training_client(
        base_model=tiny_model_dir, rank=4)
    tc.forward_backward(sft_data(tc.get_tokenizer(), ["from the command line"]), "cross_entropy").result()
    state = tc.save_state("cli-state").result().path
    sampler = tc.save_weights_for_sampler("cli-sampler").result().path
    run, session = tc.model_id, _session_of(tc)

    def ok(*commands: tuple) -> list[str]:
        """Each command (argv..., optionally {"stdin": ..., "with_key": False}) in turn, in one
        process (cli_batch.py); each must succeed. HOME is the test's: `auth login` stores there."""
        batch = []
        for command in commands:
            options = command[-1] if isinstance(command[-1], dict) else {}
            argv = list(command[:-1] if options else command)
            batch.append({"argv": argv, "stdin": options.get("stdin"), "env": {
                "TINKER_BASE_URL": stack.url, "TINKER_TELEMETRY": "0", "HOME": str(tmp_path / "home"),
                "TINKER_API_KEY": key if options.get("with_key", True) else None}})
        got = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "cli_batch.py")],
                             input=json.dumps(batch), capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert got.returncode == 0, got.stderr
        results = json.loads(got.stdout)
        for command, result in zip(batch, results):
            assert result["code"] == 0, (command["argv"], result)
        return [r["stdout"] for r in results]

    stored = {"with_key": False}
    (version, status, whoami, login, runs, logout, models, info, listed, all_listed, ckpt_info, _) = ok(
        ("version",), ("auth", "status"), ("auth", "whoami"), ("auth", "login", {"stdin": key + "\n", **stored}),
        ("-f", "json", "run", "list", stored),              # the stored credential
        ("auth", "logout", stored), ("-f", "json", "model", "list"), ("-f", "json", "run", "info", run),
        ("-f", "json", "checkpoint", "list", "--run-id", run), ("-f", "json", "checkpoint", "list"),
        ("-f", "json", "checkpoint", "info", state), ("checkpoint", "publish", state))
    assert "0.38.0" in version and "Tinker accessible: yes" in status and "tml:organization_user:" in whoami
    assert "Stored API key" in login and run in runs and "still active" in logout
    assert any(m["model_name"] for m in json.loads(models)["models"])
    assert run in info
    assert {c["tinker_path"] for c in json.loads(listed)["checkpoints"]} == {state, sampler}
    assert state in all_listed and "cli-state" in ckpt_info
    reader = tinker.RestClient(base_url=stack.url, api_key=new_user(mstack, "reader"))
    assert reader.get_weights_info_by_tinker_path(state).result().lora_rank == 4       # published
    ok(("checkpoint", "unpublish", state))
    with pytest.raises(tinker.NotFoundError):
        reader.get_weights_info_by_tinker_path(state).result()
    *_, emptied = ok(("checkpoint", "set-ttl", state, "--ttl", "7200"), ("checkpoint", "set-ttl", state, "--remove"),
                     ("checkpoint", "download", state, "--output", str(tmp_path / "dl")),
                     ("session", "export-trace", session, "-o", str(tmp_path / "trace.pftrace")),
                     ("checkpoint", "delete", sampler, "-y"),
                     ("checkpoint", "delete", "--run-id", run, "--type", "weights", "-y"),
                     ("-f", "json", "checkpoint", "list", "--run-id", run))
    assert (tmp_path / "dl" / state.replace("tinker://", "").replace("/", "_") / "adapter_model.safetensors").exists()
    assert (tmp_path / "trace.pftrace").stat().st_size > 0
    assert json.loads(emptied)["checkpoints"] == []

    env = {**os.environ, "TINKER_BASE_URL": stack.url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0",
           "HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    hub = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "push-hf", state, "--repo", "me/x"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert hub.returncode != 0 and "Not logged in" in hub.stderr, hub.stdout + hub.stderr
