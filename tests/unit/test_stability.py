"""Stability records: stable_reinforce gets the sampler's own logprobs through provenance spans."""

import numpy as np
import pytest

from gateway.db import Database
from gateway.stability import Span, StabilityRecords
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


def test_unused_records_expire_and_the_store_is_bounded():
    r = StabilityRecords(Database("sqlite://"), ttl_s=0.0, max_sequences=2)
    for i in range(3):
        r.record("s", f"q:{i}", [1], [-1.0])
    assert len(r) == 2
    assert r.expire() == 2 and len(r) == 0
