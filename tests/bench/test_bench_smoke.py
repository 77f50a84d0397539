"""Every benchmark runs end to end (a few iterations, tiny model, no verdicts), so none rots. One
`python -m bench --quick` for all of them: split one test per benchmark, two ran at once under
the two test workers, each with its own stacks, and the suite took ~30 min instead of ~21. The
quick run puts every benchmark in one process on one shared `tinkerd up` (bench/__main__.py): ~3 min
on 2 shared cores, was ~9-14 with a process and stacks of their own each."""

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


def test_every_benchmark_runs_and_reports(tmp_path):
    log = tmp_path / "bench.log"
    with open(log, "w") as out:
        try:
            code = subprocess.run([sys.executable, "-m", "bench", "--quick", "--no-smollm2", "--out", str(tmp_path)],
                                  cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=1800).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    text = log.read_text()
    done = "\n".join(line for line in text.splitlines() if line.startswith("[bench]"))
    assert code == 0, f"{code}; finished: {done}\n{text[-4000:]}"
    report = json.loads((tmp_path / "quick.json").read_text())
    seen = {row["benchmark"] for row in report["rows"]}
    assert seen == set(BENCHMARKS)
    for row in report["rows"]:
        assert math.isfinite(row["ours"]), row
        if row["ratio"] is not None:
            assert row["ratio"] > 0, row
    table = (tmp_path / "quick.md").read_text()
    assert "| benchmark | case |" in table and "train_step" in table
    from tinkerd.process import tcmalloc_library       # the allocator tinkerd's services run, rows in process too
    assert report["machine"].endswith("tcmalloc" if tcmalloc_library() else "glibc malloc"), report["machine"]
