"""`--dtype auto` and the refusal of emulated 16-bit dtypes (tinkerd/hardware.py)."""

import subprocess
import sys

import pytest

from tinkerd.hardware import DtypeRefused, cpu_flags, native_bf16, resolve_dtype

AVX2_ONLY = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def test_auto_is_bf16_where_native_and_fp32_elsewhere():
    assert resolve_dtype("auto", flags=SAPPHIRE_RAPIDS, gpu=False) == "bfloat16"
    assert resolve_dtype("auto", flags=AVX2_ONLY, gpu=True) == "bfloat16"
    assert resolve_dtype("auto", flags=AVX2_ONLY, gpu=False) == "float32"
    assert resolve_dtype("float32", flags=SAPPHIRE_RAPIDS, gpu=True) == "float32"


def test_explicit_bf16_without_native_math_is_refused_with_the_reason():
    with pytest.raises(DtypeRefused, match="slower than float32"):
        resolve_dtype("bfloat16", flags=AVX2_ONLY, gpu=False)
    assert resolve_dtype("bfloat16", flags=AVX2_ONLY, gpu=False, allow_slow=True) == "bfloat16"
    assert resolve_dtype("bfloat16", flags=SAPPHIRE_RAPIDS, gpu=False) == "bfloat16"


def test_tinkerd_up_refuses_bf16_at_start_on_this_machine_when_it_is_not_native(tmp_path):
    if native_bf16():
        pytest.skip("this machine computes bf16 natively")
    assert cpu_flags(), "no CPU flags read from /proc/cpuinfo"
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "up", "--base-model", str(tmp_path),
                          "--state-dir", str(tmp_path / "state"), "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no native bf16" in out.stderr, out.stderr[-2000:]
