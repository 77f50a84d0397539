"""A gateway that goes silent in the middle of a transaction on PostgreSQL (its link cut, its host
frozen) no longer holds its locks for hours: the server-wide sample admission lock it held
stalled every gateway's samples (tests/e2e/test_multi_host.py's database partition, seen in CI:
four samples not answered in 120 s)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
from sqlalchemy.exc import DBAPIError

from gateway.futures.store import FutureStore
from gateway.identity.limits import samples_turn
from gateway.storage.db import Database, FutureRow


@pytest.fixture(scope="module")
def postgres_url(tmp_path_factory):
    pytest.importorskip("pgserver")
    from harness.postgres import postgres

    with postgres(tmp_path_factory.mktemp("pg"), "tinkerd") as url:
        yield url


def _sample(request_id: str, owner: str) -> FutureRow:
    return FutureRow(request_id=request_id, idempotency_key=f"samp-{request_id}#0", owner=owner,
                     request_type="sample")


def test_a_gateway_silent_mid_admission_frees_the_sample_lock(postgres_url):
    silent, other = Database(postgres_url, idle_in_transaction_s=1.0), Database(postgres_url, idle_in_transaction_s=1.0)
    holding, wake = threading.Event(), threading.Event()

    def admit_then_freeze(conn):
        samples_turn(conn)                   # the server-wide sample lock, held to the commit
        holding.set()
        wake.wait(30)                        # frozen here, in the transaction

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        frozen = pool.submit(FutureStore(silent).insert, _sample("req-frozen", "alice"), admit_then_freeze)
        assert holding.wait(30)
        start = time.monotonic()
        row = FutureStore(other).insert(_sample("req-other", "bob"), samples_turn)
        waited = time.monotonic() - start
        wake.set()
        with pytest.raises(DBAPIError, match="idle-in-transaction"):
            frozen.result(30)              # its transaction was ended by the server, nothing written
    assert row.request_id == "req-other" and other.get(FutureRow, "req-other").status == "pending"
    assert silent.get(FutureRow, "req-frozen") is None
    assert 0.5 < waited < 10, waited         # about idle_in_transaction_s, not until a keepalive gives up
    # The silent gateway's next transaction runs on a fresh connection.
    assert FutureStore(silent).insert(_sample("req-again", "alice"), samples_turn).request_id == "req-again"
