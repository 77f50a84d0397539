"""docs/grpc-api.md is kept beside proto/tinkerd/v1: every service, RPC, message, enum and field
of the protos is named there (in backticks), so a proto change without its documentation fails."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]


def _proto_names() -> set[str]:
    names = set()
    for proto in sorted((REPO / "proto" / "tinkerd" / "v1").glob("*.proto")):
        text = re.sub(r"//.*", "", proto.read_text())
        names |= set(re.findall(r"\b(?:service|rpc|message|enum)\s+(\w+)", text))
        names |= set(re.findall(r"^\s*(?:repeated\s+|optional\s+)?[\w.<>, ]+?\s+(\w+)\s*=\s*\d+\s*;", text, re.M))
    return names


def test_every_proto_name_is_documented():
    documented = set(re.findall(r"`([^`]+)`", (REPO / "docs" / "grpc-api.md").read_text()))
    words = {w for d in documented for w in re.findall(r"\w+", d)}
    names = _proto_names()
    assert len(names) > 80
    missing = sorted(n for n in names if n not in words)
    assert not missing, f"docs/grpc-api.md does not mention {missing}"
