"""Every benchmark runs end to end (a few iterations, tiny model, no verdicts), so none rots. One
test per benchmark, each in its own process (`python -m bench --quick --only NAME`): the test
workers share them out (tests/conftest.py) instead of one worker running all of them in a row."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from bench.__main__ import BENCHMARKS

pytestmark = pytest.mark.e2e
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_the_benchmark_runs_and_reports(tmp_path, name):
    log = tmp_path / "bench.log"
    with open(log, "w") as out:
        try:
            code = subprocess.run([sys.executable, "-m", "bench", "--quick", "--no-smollm2", "--only", name,
                                   "--out", str(tmp_path)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=900).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    text = log.read_text()
    assert code == 0, f"{code}\n{text[-4000:]}"
    report = json.loads((tmp_path / "quick.json").read_text())
    assert {row["benchmark"] for row in report["rows"]} == {name}
    for row in report["rows"]:
        assert math.isfinite(row["ours"]), row
        if row["ratio"] is not None:
            assert row["ratio"] > 0, row
    table = (tmp_path / "quick.md").read_text()
    assert "| benchmark | case |" in table and f"| {name} |" in table
