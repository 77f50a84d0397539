"""The models of a session that stopped heart-beating are unloaded (gateway/housekeeping.py
unload_lapsed_models), but not one whose requests still arrive: a client whose heartbeats run late
kept losing the gradients of a forward_backward when its model was unloaded before the optim_step
(seen in tests/e2e/test_multi_tenant.py with a 3 s session timeout). Timestamps are set in the
database instead of waiting."""

import datetime

from gateway_fakes import gateway  # noqa: F401 - the fixture

from gateway.storage.db import ModelRow, SessionRow, aware, now


def test_a_lapsed_sessions_model_that_requests_still_use_is_not_unloaded(gateway):
    api, gw = gateway.api, gateway.api.client.app.state.gateway
    db = gw.db
    session = api.session()
    idle, used = api.model(session), api.model(session, model_seq_id=1)
    two_hours_ago = now() - datetime.timedelta(hours=2)
    db.touch(SessionRow, session, last_heartbeat=two_hours_ago)
    for model_id in (idle, used):
        db.touch(ModelRow, model_id, last_request_time=two_hours_ago)
    cutoff = now() - datetime.timedelta(seconds=gw.settings.session_timeout_s)
    assert sorted(db.models_of_lapsed_sessions(cutoff)) == sorted([idle, used])

    step = api.post("optim_step", {"model_id": used, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}})
    assert api.result(step.json()).status_code == 200
    assert db.models_of_lapsed_sessions(cutoff) == [idle]


def test_a_short_session_timeout_records_requests_finely_enough(gateway):
    """The request time is written at most every 5 s, or a third of the session timeout when
    that is shorter: a model used all along never looks unused for a whole timeout."""
    api, gw = gateway.api, gateway.api.client.app.state.gateway
    gw.settings.session_timeout_s = 3
    model_id = api.model(api.session())
    written = now() - datetime.timedelta(seconds=1.5)      # within 5 s, beyond 3 / 3
    gw.db.touch(ModelRow, model_id, last_request_time=written)
    step = api.post("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}})
    assert api.result(step.json()).status_code == 200
    assert aware(gw.db.get(ModelRow, model_id).last_request_time) > written
