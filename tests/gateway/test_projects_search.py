"""Projects and search_sessions over HTTP on fake backends (the SDK's own calls against a real
stack: tests/e2e/test_management.py): sessions in projects, who may list and move into them,
every filter of SessionSearchRequest, paging, and the refusals that name what to fix."""

from __future__ import annotations

from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture
from sqlalchemy import text

from gateway.projects import DEFAULT_PREFIX


def _session(api, **fields) -> str:
    response = api.post("create_session", {"tags": [], "sdk_version": "0.38.0", **fields})
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


def _search(api, **body) -> dict:
    response = api.post("sessions/search", body)
    assert response.status_code == 200, response.text
    return response.json()


def _ids(page: dict) -> list[str]:
    return [s["session_id"] for s in page["sessions"]]


def test_sessions_carry_their_project_and_display_name(gateway):
    api = gateway.api
    named = _session(api, project_id="proj-a", display_name="Nightly SFT run")
    plain = _session(api)
    got = api.get(f"sessions/{named}").json()
    assert (got["project_id"], got["display_name"]) == ("proj-a", "Nightly SFT run")
    assert api.get(f"sessions/{plain}").json()["project_id"] == DEFAULT_PREFIX + "tester"
    summary = _search(api, session_id=named)["sessions"]
    assert [(s["project_id"], s["display_name"], s["owner"].startswith("tml:organization_user:"))
            for s in summary] == [("proj-a", "Nightly SFT run", True)]

    bob = api.as_user("bob")
    assert_user_error(bob.post("create_session", {"tags": [], "project_id": "proj-a"}), 403, "proj-a", "member")
    assert_user_error(bob.post("create_session", {"tags": [], "project_id": DEFAULT_PREFIX + "tester"}), 403)
    assert_user_error(bob.post("create_session", {"tags": [], "project_id": DEFAULT_PREFIX + "carol"}), 400,
                      "default-bob")
    assert_user_error(bob.post("create_session", {"tags": [], "project_id": "has space"}), 400, "not a project id")


def test_a_session_moves_with_its_runs_and_only_into_a_project_the_caller_may_use(gateway):
    api, bob = gateway.api, gateway.api.as_user("bob")
    session = _session(api, project_id="proj-a")
    run = api.model(session)
    assert api.request("PUT", f"sessions/{session}/project", json={"project_id": "proj-b"}).status_code == 200
    assert api.get(f"sessions/{session}").json()["project_id"] == "proj-b"
    in_b = api.get("training_runs", params={"project_id": "proj-b"}).json()["training_runs"]
    assert [r["training_run_id"] for r in in_b] == [run]
    assert api.get("training_runs", params={"project_id": "proj-a"}).json()["training_runs"] == []

    _session(bob, project_id="proj-bob")
    assert_user_error(api.request("PUT", f"sessions/{session}/project", json={"project_id": "proj-bob"}), 403)
    assert_user_error(bob.request("PUT", f"sessions/{session}/project", json={"project_id": "proj-bob"}), 404)
    assert_user_error(api.request("PUT", f"sessions/{session}/project", json={}), 400, "project_id is required")
    assert api.get(f"sessions/{session}").json()["project_id"] == "proj-b"

    # An admin moves bob's session into proj-b: bob is a member of proj-b from then on.
    admin = api.as_user("root", admin=True)
    bobs = _session(bob)
    assert admin.request("PUT", f"sessions/{bobs}/project", json={"project_id": "proj-b"}).status_code == 200
    assert _search(bob, owner={"type": "accessible"}, project_ids=["proj-b"])["sessions"][0]["session_id"] in (
        bobs, session)


def test_every_filter(gateway):
    api, bob = gateway.api, gateway.api.as_user("bob")
    a = _session(api, display_name="Nightly SFT alpha", project_id="shared", user_metadata={"team": "rl", "n": 3})
    b = _session(api, display_name="nightly RL beta", user_metadata={"team": "sft"})
    c = _session(api)
    bobs = _session(bob, display_name="bob nightly")
    elsewhere = _session(bob, display_name="nightly private")
    admin = api.as_user("root", admin=True)     # only a member or an admin puts bob's session into "shared"
    assert admin.request("PUT", f"sessions/{bobs}/project", json={"project_id": "shared"}).status_code == 200
    api.post(f"sessions/{c}/finish", {"reason": {"type": "interrupted"}, "detail": "ctrl-c"})

    assert _ids(_search(api)) == [c, b, a]                       # own, newest first
    assert _ids(_search(api, display_name="NIGHTLY")) == [b, a]
    assert _ids(_search(api, display_name="sft nightly")) == [a]    # every word, any order
    assert _ids(_search(api, display_name="beta", session_id=a)) == [b, a]   # either one
    assert _ids(_search(api, user_metadata={"team": "rl", "n": "3"})) == [a]
    assert _ids(_search(api, user_metadata={"team": "rl", "n": "4"})) == []
    assert _ids(_search(api, project_ids=["shared"])) == [a]
    assert _ids(_search(api, owner={"type": "accessible"}, display_name="nightly")) == [bobs, b, a]
    bob_urn = _search(bob)["sessions"][0]["owner"]
    assert _ids(_search(api, owner={"type": "user", "owner_urns": [bob_urn]})) == [bobs]
    assert elsewhere not in _ids(_search(api, owner={"type": "accessible"}))
    assert _ids(_search(bob, owner={"type": "accessible"}, project_ids=["shared"])) == [bobs, a]

    finished = _search(api, statuses=[{"type": "client_finished", "reasons": ["interrupted"]}])["sessions"]
    assert [(s["session_id"], s["status"]) for s in finished] == [
        (c, {"type": "client_finished", "reason": {"type": "interrupted"}, "detail": "ctrl-c"})]
    assert _ids(_search(api, statuses=[{"type": "active"}])) == [b, a]
    assert _ids(_search(api, statuses=[{"type": "failed"}, {"type": "cancelled"}])) == []
    assert _ids(_search(api, statuses=[{"type": "client_finished", "reasons": ["success"]}])) == []

    assert_user_error(api.post("sessions/search", {"project_ids": [DEFAULT_PREFIX + "bob"]}), 400, "may list")
    assert_user_error(api.post("sessions/search", {"owner": {"type": "user", "owner_urns": ["tml:organization_user:x"]}}),
                      400, "tml:organization_user:x")
    assert_user_error(api.post("sessions/search", {"limit": 201}), 400, "limit")
    assert_user_error(api.post("sessions/search", {"statuses": []}), 400, "statuses")


def test_pages_walk_every_match_once_and_a_cursor_from_another_query_is_refused(gateway):
    api = gateway.api
    made = [_session(api, display_name=f"page {i}") for i in range(7)]
    seen, body = [], {"display_name": "page", "limit": 3}
    while True:
        page = _search(api, **body)
        seen += _ids(page)
        if page["next_cursor"] is None:
            break
        body["cursor"] = page["next_cursor"]
    assert seen == made[::-1]

    other = _session(api, display_name="other")
    cursor = _search(api, display_name="other", limit=1)
    first = _search(api, limit=1)
    assert _ids(first) == [other] and cursor["next_cursor"] is None
    foreign = _search(api, display_name="page", limit=2)["next_cursor"]
    refused = api.post("sessions/search", {"display_name": "other", "cursor": foreign})
    assert_user_error(refused, 400, "cursor", "not a result of this query")
    assert_user_error(api.post("sessions/search", {"cursor": {**foreign, "last_created_at": "2020-01-01T00:00:00"}}),
                      400, "time zone")


def test_the_search_walks_an_index_newest_first(gateway):
    """No sort of all the sessions: SQLite reads them in order from the indexes, and a later page
    seeks to its cursor (at 100k sessions a page costs 4-8 ms at any depth; an admin's search
    through IN (the org's users) sorted the whole table: 525 ms)."""
    db = gateway.api.client.app.state.gateway.db
    with db.engine.connect() as conn:
        for where in ("owner = 'u'", "project_id IN ('p')", "1 = 1",
                      # an admin's (gateway/projects.py in_org), a page further down (a row value)
                      "EXISTS (SELECT 1 FROM users WHERE users.user_id = sessions.owner AND users.org_id = 'o') "
                      "AND (created_at, session_id) < ('2026-01-01 00:00:00.000000', 'sess-x')"):
            plan = " ".join(str(r[-1]) for r in conn.execute(text(
                f"EXPLAIN QUERY PLAN SELECT session_id FROM sessions WHERE {where} "
                f"ORDER BY created_at DESC, session_id DESC LIMIT 51")))
            assert "USING" in plan and "INDEX" in plan and "TEMP B-TREE" not in plan, (where, plan)
