"""The gateway on PostgreSQL (`--db-url`): the every-endpoint SDK script passes, and sessions,
runs and checkpoints are still there after the whole stack restarts. The server is PostgreSQL 16
from the `pgserver` wheel, started in a temporary directory (unix socket, no TCP port)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdk_probe.py")


@pytest.fixture(scope="module")
def postgres_url(tmp_path_factory):
    from harness.postgres import postgres

    with postgres(tmp_path_factory.mktemp("pg"), "tinkerd") as url:
        yield url


def test_gateway_on_postgres_survives_a_restart(postgres_url, tiny_model_dir, tmp_path, start_stack):
    import tinker

    state_dir = tmp_path / "state"
    with start_stack(tiny_model_dir, state_dir, "--db-url", postgres_url) as s:
        out = subprocess.run([sys.executable, PROBE, s.url, tiny_model_dir], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "TINKER_API_KEY": s.api_key, "TINKER_TELEMETRY": "0"})
        assert out.returncode == 0 and "ALL DONE" in out.stdout, out.stdout[-3000:] + out.stderr[-5000:]
    assert not (state_dir / "tinkerd.db").exists()        # nothing went to SQLite
    state_path = re.search(r"^OK save_state (\S+)", out.stdout, re.M).group(1)

    with start_stack(tiny_model_dir, state_dir, "--db-url", postgres_url) as s:
        rest = tinker.RestClient(base_url=s.url)
        assert state_path in {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
        run_id = state_path.split("/")[2]
        assert rest.get_training_run(run_id).result().base_model == tiny_model_dir
        resumed = tinker.ServiceClient(base_url=s.url).create_training_client_from_state(state_path).result()
        datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                                   loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3})
        assert resumed.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
