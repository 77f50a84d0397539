"""Conversions between tinkerd.v1.Tensor messages and numpy / torch arrays."""

from __future__ import annotations

import numpy as np

from tinkerd.v1 import common_pb2

_NP_BY_DTYPE = {
    common_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    common_pb2.DTYPE_INT64: np.dtype("<i8"),
    common_pb2.DTYPE_INT32: np.dtype("<i4"),
    common_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
}
_DTYPE_BY_NP = {v: k for k, v in _NP_BY_DTYPE.items()}


def to_numpy(t: common_pb2.Tensor) -> np.ndarray:
    if t.dtype not in _NP_BY_DTYPE:
        raise ValueError(f"unsupported tensor dtype {common_pb2.DType.Name(t.dtype)}")
    arr = np.frombuffer(t.data, dtype=_NP_BY_DTYPE[t.dtype])
    shape = tuple(t.shape) if t.shape else (arr.size,)
    if int(np.prod(shape)) != arr.size:
        raise ValueError(f"tensor data has {arr.size} elements, shape {list(shape)} needs {int(np.prod(shape))}")
    return arr.reshape(shape)


def from_numpy(arr: np.ndarray) -> common_pb2.Tensor:
    arr = np.ascontiguousarray(arr)
    dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    if dtype not in _DTYPE_BY_NP:
        arr = arr.astype(np.float32 if arr.dtype.kind == "f" else np.int64)
        dtype = arr.dtype
    return common_pb2.Tensor(dtype=_DTYPE_BY_NP[dtype], shape=list(arr.shape), data=arr.tobytes())


# torch dtype names (as tinkerd.weight_stream writes them) <-> wire dtypes.
DTYPE_BY_NAME = {
    "float32": common_pb2.DTYPE_FLOAT32, "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float16": common_pb2.DTYPE_FLOAT16, "int64": common_pb2.DTYPE_INT64, "int32": common_pb2.DTYPE_INT32,
}
NAME_BY_DTYPE = {v: k for k, v in DTYPE_BY_NAME.items()}
