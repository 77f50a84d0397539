"""`tinker` CLI commands run one after another in one fresh process: each `python -m tinker.cli`
process spends ~2.5 s of a core importing the SDK. Each command is the CLI's click group run as
its `main()` runs it, with its own argv, stdin and environment (click's CliRunner); a command's
TinkerCliError is reported as `main()` reports it. Reads [{argv, stdin, env}] as JSON on stdin,
writes [{code, stdout, stderr}]."""

from __future__ import annotations

import json
import sys

from click.testing import CliRunner
from tinker.cli.__main__ import main_cli
from tinker.cli.exceptions import TinkerCliError


def run(argv: list[str], stdin: str | None, env: dict[str, str | None]) -> dict:
    got = CliRunner().invoke(main_cli, argv, input=stdin, env=env)
    stderr = got.stderr
    if isinstance(got.exception, TinkerCliError):
        stderr += f"Error: {got.exception.message}\n{got.exception.details or ''}"
    elif got.exception is not None and not isinstance(got.exception, SystemExit):
        stderr += f"{type(got.exception).__name__}: {got.exception}"
    return {"code": got.exit_code, "stdout": got.stdout, "stderr": stderr}


if __name__ == "__main__":
    json.dump([run(c["argv"], c.get("stdin"), c.get("env") or {}) for c in json.load(sys.stdin)], sys.stdout)
