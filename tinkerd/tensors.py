"""Conversions between tinkerd.v1.Tensor messages and numpy arrays (dtypes: tinkerd.dtypes)."""

from __future__ import annotations

import numpy as np

from tinkerd import dtypes
from tinkerd.v1 import common_pb2


def to_numpy(t: common_pb2.Tensor) -> np.ndarray:
    try:
        np_dtype = dtypes.by_wire(t.dtype).numpy
    except ValueError:
        np_dtype = None
    if np_dtype is None:
        raise ValueError(f"unsupported tensor dtype {common_pb2.DType.Name(t.dtype)}")
    arr = np.frombuffer(t.data, dtype=np_dtype)
    shape = tuple(t.shape) if t.shape else (arr.size,)
    if int(np.prod(shape)) != arr.size:
        raise ValueError(f"tensor data has {arr.size} elements, shape {list(shape)} needs {int(np.prod(shape))}")
    return arr.reshape(shape)


def from_numpy(arr: np.ndarray) -> common_pb2.Tensor:
    """Dtypes the wire lacks become float32 (floating point) or int64 (anything else)."""
    arr = np.ascontiguousarray(arr)
    row = dtypes.by_numpy(arr.dtype)
    if row is None or row.wire is None:
        arr = arr.astype(np.float32 if arr.dtype.kind == "f" else np.int64)
        row = dtypes.by_numpy(arr.dtype)
    return common_pb2.Tensor(dtype=row.wire, shape=list(arr.shape), data=_little_endian(arr).tobytes())


def _little_endian(arr: np.ndarray) -> np.ndarray:
    return arr.astype(arr.dtype.newbyteorder("<")) if arr.dtype.byteorder == ">" else arr
