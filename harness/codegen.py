"""Generates the Python gRPC/protobuf stubs from proto/ into the source tree.

`proto/tinkerd/v1/*.proto` becomes `tinkerd/v1/*_pb2*.py`, and `proto/gateway/*.proto`
becomes `gateway/*_pb2.py`, so generated imports (`from tinkerd.v1 import common_pb2`) are
plain absolute package imports. The stubs are committed; tests/unit/test_codegen.py fails
when they are stale. Run: `python -m harness.codegen`.
"""

from __future__ import annotations

import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_root: pathlib.Path = REPO_ROOT) -> list[pathlib.Path]:
    """Runs protoc over every proto file; returns the generated files."""
    from grpc_tools import protoc
    import importlib.resources

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc", f"-I{PROTO_ROOT}", f"-I{include}",
        f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    generated = []
    for f in files:
        stem = out_root / f.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = stem.parent / (stem.name + suffix)
            if path.exists():
                generated.append(path)
    return generated


if __name__ == "__main__":
    for path in generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT):
        print(path)
