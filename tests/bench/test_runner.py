"""`python -m bench`'s runner: one failing benchmark is reported, and the others' rows still make
the table (a whole run takes an hour or more)."""

import json
import subprocess
import types

import pytest

from bench import __main__ as runner
from bench.common import Context


def test_a_failed_benchmark_is_reported_and_the_others_still_run(monkeypatch, tmp_path):
    def fake_run(cmd, cwd):
        name, rows_to = cmd[cmd.index("--one") + 1], cmd[cmd.index("--rows-to") + 1]
        if name == "sampling":
            return subprocess.CompletedProcess(cmd, 1)
        with open(rows_to, "w") as f:
            json.dump({"rows": [{"benchmark": name, "case": "c", "ours": 1.0, "raw": 2.0, "unit": "s", "ratio": 0.5,
                                 "target": ">= 0.9"}], "notes": []}, f)
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    ctx = Context(quick=False, work_dir=str(tmp_path), models={"tiny": "tiny"})
    args = types.SimpleNamespace(only="train_step,sampling,futures", quick=False, no_smollm2=True)
    rows, notes, failed = runner.run_all(ctx, args)
    assert [r.benchmark for r in rows] == ["train_step", "futures"] and failed == ["sampling"]
    assert rows[0].met is False                       # verdicts as in a whole run
    runner.write_results(ctx, str(tmp_path), rows, notes, 1.0, failed)
    assert "Failed (no rows; see the run's output): sampling" in (tmp_path / "latest.md").read_text()
    assert json.loads((tmp_path / "latest.json").read_text())["failed"] == ["sampling"]


def test_an_unknown_benchmark_name_is_refused_with_the_names_there_are(capsys):
    with pytest.raises(SystemExit):
        runner.parse_args(["--only", "train_step,sampleing"])
    assert "no benchmark named sampleing; there are train_step" in capsys.readouterr().err


@pytest.mark.parametrize("value, target, met", [(0.95, ">= 0.9", True), (0.9, "> 0.9", False), (90, "<= 100", True),
                                                (999, "< 1000", True), (1000, "< 1000", False)])
def test_every_target_a_benchmark_states_has_a_verdict(value, target, met):
    from bench.common import check

    assert check(value, target) is met
