"""The gateway's connection pool (gateway/storage/db.py `_pool_order`) hands back the connection
returned last: SQLite drops a connection's page cache when another connection has committed, and
a FIFO pool handed its connections out in turn (strace of a gateway: ~30 page reads a request,
~2 with LIFO). An in-memory database, one connection a thread, opens as before."""

from gateway.storage.db import Database


def _dbapi(conn):
    return conn.connection.driver_connection


def test_the_connection_returned_last_is_handed_out_next(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'pool.db'}")
    first, second = db.engine.connect(), db.engine.connect()
    used_first, used_second = _dbapi(first), _dbapi(second)
    second.close()
    first.close()               # returned last
    with db.engine.connect() as again:
        assert _dbapi(again) is used_first and used_first is not used_second


def test_an_in_memory_database_opens():
    for url in ("sqlite://", "sqlite:///:memory:"):
        db = Database(url)
        with db.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1
