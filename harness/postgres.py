"""PostgreSQL for the tests (the `pgserver` wheel) in a temporary directory, unix socket only.

The server is started by a small child process of its own, not by the test process: running as
root, pgserver starts initdb under another uid, which Python can only do by fork(), and a pytest
worker that has run vLLM and DeepSpeed in-process holds gigabytes that fork() must be able to
commit (it failed with ENOMEM in the suite while stacks ran beside it).

    with postgres(directory, "tinkerd") as url:     # a SQLAlchemy URL (psycopg) of a new database
        ...

`postgres_on(host, directory, "tinkerd")` runs it on a harness/hosts.py host instead, listening on
TCP at the host's address (port 5432; every client on the bridge trusted): a database host.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from typing import Iterator


@contextlib.contextmanager
def postgres(directory, database: str) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "harness.postgres", str(directory), database],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        uri = proc.stdout.readline().strip()
        if not uri.startswith("postgresql://"):
            raise RuntimeError(f"pgserver did not start (exit {proc.wait(timeout=60)})")
        # postgresql://postgres:@/postgres?host=<socket dir>  ->  the psycopg driver, `database`
        yield re.sub(r"^postgresql://(.*)/postgres\?", rf"postgresql+psycopg://\1/{database}?", uri)
    finally:
        proc.stdin.close()            # the child stops the server and exits
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def postgres_on(host, directory, database: str) -> Iterator[str]:
    """PostgreSQL on `host` (harness/hosts.py), reached over TCP at its address."""
    proc = host.popen([sys.executable, "-m", "harness.postgres", str(directory), database, host.address],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        uri = proc.stdout.readline().strip()
        if not uri.startswith("postgresql://"):
            raise RuntimeError(f"pgserver did not start on host {host.name} (exit {proc.wait(timeout=60)})")
        yield f"postgresql+psycopg://postgres@{host.address}:{PORT}/{database}"
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


PORT = 5432


def _serve(directory: str, database: str, address: str = "") -> None:
    import pgserver

    server = pgserver.get_server(directory, cleanup_mode="stop")
    # A throwaway server: commits need not wait for the disk (each request commits several times).
    server.psql("ALTER SYSTEM SET synchronous_commit = off;")
    server.psql("ALTER SYSTEM SET fsync = off;")
    server.psql("SELECT pg_reload_conf();")
    server.psql(f"CREATE DATABASE {database};")
    if address:
        _listen_on(server, address)
    print(server.get_uri(), flush=True)
    sys.stdin.read()                  # until the parent closes it
    server.cleanup()


def _listen_on(server, address: str) -> None:
    """Restarts the server listening on TCP at `address` too (pgserver starts it with `-h ""`,
    which a setting cannot override), trusting every client: only the test's bridge reaches it."""
    from pgserver._commands import pg_ctl

    info = server.get_postmaster_info()
    with open(server.pgdata / "pg_hba.conf", "a") as f:
        f.write("host all all 0.0.0.0/0 trust\n")
    pg_ctl(["-w", "stop"], pgdata=server.pgdata, user=server.system_user)
    pg_ctl(["-w", "-o", f'-h "{address}"', "-o", f"-p {PORT}", "-o", f"-k {info.socket_dir}",
            "-l", str(server.log), "start"], pgdata=server.pgdata, user=server.system_user, timeout=30)


if __name__ == "__main__":
    _serve(*sys.argv[1:4])
