"""The one dtype table: a dtype's torch name, wire enum, numpy dtype and safetensors code.

Torch-free at import time (the gateway imports it): torch dtypes come from `torch_dtype`, which
imports torch when first called.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tinkerd.v1 import common_pb2


@dataclasses.dataclass(frozen=True)
class DtypeRow:
    name: str                  # torch's name: the dtype is getattr(torch, name)
    wire: int | None           # tinkerd.v1 DType value; None where the wire has no such dtype
    numpy: np.dtype | None     # little-endian; None for bfloat16, which numpy lacks
    safetensors: str           # the dtype code in a .safetensors header

    @property
    def wire_name(self) -> str | None:
        """The enum name, e.g. "DTYPE_FLOAT32" (the gateway's SDK wire schema uses the same names)."""
        return None if self.wire is None else common_pb2.DType.Name(self.wire)


TABLE = (
    DtypeRow("float32", common_pb2.DTYPE_FLOAT32, np.dtype("<f4"), "F32"),
    DtypeRow("bfloat16", common_pb2.DTYPE_BFLOAT16, None, "BF16"),
    DtypeRow("float16", common_pb2.DTYPE_FLOAT16, np.dtype("<f2"), "F16"),
    DtypeRow("int64", common_pb2.DTYPE_INT64, np.dtype("<i8"), "I64"),
    DtypeRow("int32", common_pb2.DTYPE_INT32, np.dtype("<i4"), "I32"),
    # Only in safetensors files (weight_stream writes whatever an adapter holds).
    DtypeRow("float64", None, np.dtype("<f8"), "F64"),
    DtypeRow("int16", None, np.dtype("<i2"), "I16"),
    DtypeRow("int8", None, np.dtype("i1"), "I8"),
    DtypeRow("uint8", None, np.dtype("u1"), "U8"),
    DtypeRow("bool", None, np.dtype("?"), "BOOL"),
)

_BY_NAME = {r.name: r for r in TABLE}
_BY_WIRE = {r.wire: r for r in TABLE if r.wire is not None}
_BY_WIRE_NAME = {r.wire_name: r for r in TABLE if r.wire is not None}
_BY_NUMPY = {r.numpy: r for r in TABLE if r.numpy is not None}


def _lookup(table: dict, key, what: str) -> DtypeRow:
    row = table.get(key)
    if row is None:
        raise ValueError(f"unsupported dtype {what} {key!r}")
    return row


def by_name(name: str) -> DtypeRow:
    """By torch's name, e.g. "bfloat16"."""
    return _lookup(_BY_NAME, name, "name")


def by_wire(value: int) -> DtypeRow:
    """By tinkerd.v1 DType value."""
    return _lookup(_BY_WIRE, value, "wire value")


def by_wire_name(name: str) -> DtypeRow:
    """By DType enum name, e.g. "DTYPE_FLOAT32"."""
    return _lookup(_BY_WIRE_NAME, name, "wire name")


def by_numpy(dtype: np.dtype) -> DtypeRow | None:
    """The row of a (native or little-endian) numpy dtype, or None."""
    return _BY_NUMPY.get(np.dtype(dtype).newbyteorder("<"))


def torch_dtype(name: str):
    import torch

    return getattr(torch, by_name(name).name)
