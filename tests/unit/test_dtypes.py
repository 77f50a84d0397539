"""The one dtype table: every row round-trips between its names, wire enum, numpy and torch."""

import sys

import numpy as np
import pytest
import torch

from tinkerd import dtypes, tensors
from tinkerd.v1 import common_pb2


@pytest.mark.parametrize("row", dtypes.TABLE, ids=lambda r: r.name)
def test_row_round_trips(row):
    assert dtypes.by_name(row.name) is row
    assert dtypes.torch_dtype(row.name) == getattr(torch, row.name)
    assert torch.empty(0, dtype=dtypes.torch_dtype(row.name)).dtype == getattr(torch, row.name)
    if row.numpy is not None:
        assert dtypes.by_numpy(row.numpy) is row
        assert torch.from_numpy(np.zeros(1, row.numpy)).dtype == dtypes.torch_dtype(row.name)
    if row.wire is not None:
        assert dtypes.by_wire(row.wire) is row
        assert dtypes.by_wire_name(row.wire_name) is row
        assert common_pb2.DType.Value(row.wire_name) == row.wire
    if row.wire is not None and row.numpy is not None:
        arr = np.arange(6).astype(row.numpy).reshape(2, 3)
        t = tensors.from_numpy(arr)
        assert t.dtype == row.wire and np.array_equal(tensors.to_numpy(t), arr)


def test_every_wire_dtype_has_a_row():
    wire = {v for v in common_pb2.DType.values() if v != common_pb2.DTYPE_UNSPECIFIED}
    assert wire == {r.wire for r in dtypes.TABLE if r.wire is not None}


def test_wire_lacks_become_float32_or_int64_and_bfloat16_is_not_numpy():
    assert tensors.from_numpy(np.zeros(2, np.float64)).dtype == common_pb2.DTYPE_FLOAT32
    assert tensors.from_numpy(np.zeros(2, np.int8)).dtype == common_pb2.DTYPE_INT64
    assert tensors.from_numpy(np.zeros(2, ">f4")).dtype == common_pb2.DTYPE_FLOAT32
    with pytest.raises(ValueError, match="DTYPE_BFLOAT16"):
        tensors.to_numpy(common_pb2.Tensor(dtype=common_pb2.DTYPE_BFLOAT16, shape=[1], data=b"\0\0"))
    with pytest.raises(ValueError):
        dtypes.by_name("complex64")


def test_the_table_imports_without_torch():
    import subprocess
    code = "import sys, tinkerd.dtypes, tinkerd.tensors; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
