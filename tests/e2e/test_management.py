"""SDK 0.38's management surface with the unmodified SDK and its `tinker` CLI against a real
`tinkerd up`, on SQLite and on PostgreSQL: projects and session search.

Each test acts as users of its own (keys made in the stack's database), so what they see is
what those users made."""

from __future__ import annotations

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
