"""Stability records: stable_reinforce gets the sampler's own logprobs through provenance spans."""

import numpy as np
import pytest

from gateway.stability import Span, StabilityRecords
from gateway.storage.db import Database, SessionRow
from tinkerd.errors import UserError


def _records():
    r = StabilityRecords(Database("sqlite://"), ttl_s=60)
    r.record("sess-a", "req1:0", [7, 8, 9], [-0.5, -1.5, -2.5])
    return r


def test_sampled_positions_take_the_recorded_logprobs():
    # prompt [1, 2, 3] then sampled [7, 8, 9]: targets are [2, 3, 7, 8, 9]
    spans = [Span(False, "req1:0", 1, 2), Span(True, "req1:0", 0, 3)]
    lp = _records().behaviour_logprobs("sess-a", 0, spans, np.array([2, 3, 7, 8, 9]),
                                       np.array([-9.0, -9.0, 0.0, 0.0, 0.0]))
    assert lp.tolist() == [-9.0, -9.0, -0.5, -1.5, -2.5]


def test_a_suffix_of_a_sample():
    lp = _records().behaviour_logprobs("sess-a", 0, [Span(True, "req1:0", 1, 2)], np.array([8, 9]), None)
    assert lp.tolist() == [-1.5, -2.5]


@pytest.mark.parametrize("session, spans, targets, message", [
    ("sess-a", [], [7, 8, 9], "needs provenance"),
    ("sess-a", [Span(True, "req1:0", 0, 2)], [7, 8, 9], "cover 2 positions"),
    ("sess-a", [Span(True, "req1:0", 0, 3)], [7, 8, 10], "not the tokens sampled"),
    ("sess-a", [Span(True, "req1:0", 1, 3)], [8, 9, 10], "past the 3 tokens"),
    ("sess-a", [Span(True, "req9:0", 0, 3)], [7, 8, 9], "no stability record"),
    ("sess-b", [Span(True, "req1:0", 0, 3)], [7, 8, 9], "no stability record"),   # another session's
])
def test_bad_provenance_is_a_user_error(session, spans, targets, message):
    with pytest.raises(UserError, match=message):
        _records().behaviour_logprobs(session, 0, spans, np.array(targets), None)


def test_unused_records_expire():
    r = StabilityRecords(Database("sqlite://"), ttl_s=0.0)
    for i in range(3):
        r.record("s", f"q:{i}", [1], [-1.0])
    assert len(r) == 3
    assert r.expire() == 3 and len(r) == 0


def _two_users(**caps) -> StabilityRecords:
    db = Database("sqlite://")
    db.add(SessionRow(session_id="sess-a", owner="alice"))
    db.add(SessionRow(session_id="sess-a2", owner="alice"))
    db.add(SessionRow(session_id="sess-b", owner="bob"))
    return StabilityRecords(db, ttl_s=60, **caps)


def test_each_user_is_capped_in_bytes_and_cannot_push_out_anyone_elses():
    r = _two_users(max_bytes_per_user=64 << 10)
    r.record("sess-b", "b:0", [7, 8, 9], [-0.5, -1.5, -2.5])
    for i in range(40):             # 1000 tokens: ~12 KB a record, over two sessions of alice's
        r.record_all(f"sess-a{'2' if i % 2 else ''}", {f"a{i}:0": (np.arange(1000), np.zeros(1000))})
    records, size = r.held_by("alice")
    assert size <= 64 << 10 and 2 <= records < 40
    kept = r._lookup("sess-a2", [Span(True, "a39:0", 0, 1)]) | r._lookup("sess-a", [Span(True, "a38:0", 0, 1)])
    assert sorted(kept) == ["a38:0", "a39:0"]                  # the newest stay
    assert r._lookup("sess-a", [Span(True, "a0:0", 0, 1)]) == {}   # the oldest went
    lp = r.behaviour_logprobs("sess-b", 0, [Span(True, "b:0", 0, 3)], np.array([7, 8, 9]), None)
    assert lp.tolist() == [-0.5, -1.5, -2.5] and r.held_by("bob")[0] == 1


def test_each_user_is_capped_in_records():
    r = _two_users(max_sequences_per_user=8)
    r.record("sess-b", "b:0", [1], [-1.0])
    r.record_all("sess-a", {f"a{i}:0": ([1], [-1.0]) for i in range(20)})
    assert r.held_by("alice")[0] <= 8 and r.held_by("bob")[0] == 1


def test_a_user_is_counted_only_when_what_was_added_could_reach_a_cap(monkeypatch):
    """An RL loop records every sample's sequences: counting the user's rows on each (a walk over
    all of them) made a step's cost grow with the run. They are counted when what was recorded
    since the last count could take them past a cap, or comes to a sixteenth of one."""
    r = _two_users(max_sequences_per_user=1600, max_bytes_per_user=256 << 20)
    counts = []
    held = StabilityRecords._held
    monkeypatch.setattr(StabilityRecords, "_held", staticmethod(lambda conn, owner: counts.append(owner)
                                                                or held(conn, owner)))
    for step in range(40):                       # 40 samples of 8 sequences: 320 rows
        r.record_all("sess-a", {f"s{step}:{i}": ([1, 2, 3], [-1.0, -1.0, -1.0]) for i in range(8)})
    assert len(counts) == 4          # the first, then every 13th sample (104 rows added: over 1600 / 16)
    for step in range(40, 400):                  # on to 3,200 rows: the cap holds, counted as it nears it
        r.record_all("sess-a", {f"s{step}:{i}": ([1, 2, 3], [-1.0, -1.0, -1.0]) for i in range(8)})
    assert r.held_by("alice")[0] <= 1600
    assert len(counts) <= 400 // 12             # still about every 13th sample
