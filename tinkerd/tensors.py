"""Conversions between tinkerd.v1.Tensor messages and numpy arrays (dtypes: tinkerd.dtypes)."""

from __future__ import annotations

import numpy as np

from tinkerd import dtypes
from tinkerd.v1 import common_pb2


def to_numpy(t: common_pb2.Tensor) -> np.ndarray:
    """The tensor as a dense array (a sparse one is made dense here, where it is used)."""
    try:
        np_dtype = dtypes.by_wire(t.dtype).numpy
    except ValueError:
        np_dtype = None
    if np_dtype is None:
        raise ValueError(f"unsupported tensor dtype {common_pb2.DType.Name(t.dtype)}")
    arr = np.frombuffer(t.data, dtype=np_dtype)
    if t.HasField("sparse_csr"):
        return dense(t.sparse_csr.crow_indices, t.sparse_csr.col_indices, arr, tuple(t.shape))
    shape = tuple(t.shape) if t.shape else (arr.size,)
    if int(np.prod(shape)) != arr.size:
        raise ValueError(f"tensor data has {arr.size} elements, shape {list(shape)} needs {int(np.prod(shape))}")
    return arr.reshape(shape)


def csr_indices(crow_indices: bytes, col_indices: bytes, values: int, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """A CSR tensor's row and column index of each stored value, checked; ValueError if malformed."""
    if len(shape) != 2 or any(n < 0 for n in shape):
        raise ValueError(f"a sparse tensor needs a 2-D shape, got {list(shape)}")
    if len(crow_indices) % 8 or len(col_indices) % 8:
        raise ValueError("sparse CSR indices are not a whole number of int64")
    crow = np.frombuffer(crow_indices, dtype="<i8")
    col = np.frombuffer(col_indices, dtype="<i8")
    if (len(crow) != shape[0] + 1 or len(col) != values or crow[0] != 0 or crow[-1] != len(col)
            or (np.diff(crow) < 0).any() or (len(col) and (col.min() < 0 or col.max() >= shape[1]))):
        raise ValueError("malformed sparse CSR tensor")
    return np.repeat(np.arange(shape[0]), np.diff(crow)), col


def dense(crow_indices: bytes, col_indices: bytes, values: np.ndarray, shape: tuple) -> np.ndarray:
    rows, cols = csr_indices(crow_indices, col_indices, len(values), shape)
    out = np.zeros(shape, dtype=values.dtype)
    out[rows, cols] = values
    return out


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
