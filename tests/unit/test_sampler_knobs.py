"""vLLM's scale knobs (--tensor-parallel-size, --gpu-memory-utilization, --max-num-seqs,
--kv-cache-mib, --kv-block-tokens) reach the engine: from `tinkerd sampler`'s flags (and `tinkerd up`'s, through each
replica's command line) to the real vllm.EngineArgs the replica's engine is built from. The engine itself is not started
(that is what every e2e test does): its constructor is stopped once it has the EngineArgs. A
tensor-parallel size this machine cannot run ends `tinkerd sampler` and `tinkerd up` at once,
with the reason."""

from __future__ import annotations

import os
import pytest

from launcher import cli, up
from sampler_service import server
from sampler_service.settings import SamplerSettings
from tinkerd import settings
from tinkerd.errors import UserError

KNOBS = ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.55", "--max-num-seqs", "12",
         "--kv-cache-mib", "48", "--kv-block-tokens", "64"]


class _Built(Exception):
    """Raised in place of building the engine, carrying the EngineArgs it was given."""


def test_the_sampler_flags_reach_vllms_engine_args(monkeypatch, tmp_path):
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine


    def capture(engine_args, *a, **kw):
        raise _Built(engine_args)
    monkeypatch.setattr(LLMEngine, "from_engine_args", capture)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")

    # `tinkerd up`'s flags become each replica's `tinkerd sampler` command line ...
    up_args = cli.build_parser().parse_args(["up", "--base-model", str(tmp_path), "--sampler-replicas", "2",
                                             *KNOBS])
    argv = up.child_argv(up_args, "sampler-2", register_with=["http://127.0.0.1:8000"])
    # ... which `tinkerd sampler` parses into its settings ...
    args = cli.build_parser().parse_args(argv)
    assert args.command == "sampler"
    sampler_settings = settings.from_args(up.CHILDREN["sampler"], args)
    # ... from which the replica builds its engine.
    with pytest.raises(_Built) as built:
        server.engine_from(sampler_settings)
    engine_args = built.value.args[0]
    assert isinstance(engine_args, EngineArgs)
    assert (engine_args.tensor_parallel_size, engine_args.gpu_memory_utilization, engine_args.max_num_seqs) == \
        (2, 0.55, 12)
    # The KV cache's size: vLLM would take VLLM_CPU_KVCACHE_SPACE's whole GiB over it on CPU.
    assert engine_args.kv_cache_memory_bytes == 48 << 20 and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    assert engine_args.model == str(tmp_path) and engine_args.enable_lora
    assert engine_args.block_size == 64


def test_a_cpu_engine_pages_its_kv_cache_in_blocks_a_prompt_can_fill(monkeypatch):
    """vLLM's CPU default (128 tokens) is longer than an RL prompt: no prefix is ever shared."""
    from sampler_service import engine
    from tinkerd import hardware
    from tinkerd.errors import UserError

    monkeypatch.setattr(hardware, "has_gpu", lambda: False)
    assert engine.engine_args("m")["block_size"] == engine.CPU_KV_BLOCK_TOKENS == 32
    assert engine.engine_args("m", kv_block_tokens=128)["block_size"] == 128
    monkeypatch.setattr(hardware, "has_gpu", lambda: True)
    assert "block_size" not in engine.engine_args("m")          # vLLM's own choice on a GPU
    with pytest.raises(UserError, match="--kv-block-tokens"):
        engine.engine_args("m", kv_block_tokens=-1)


def test_a_tensor_parallel_size_this_machine_cannot_run_is_refused_with_the_reason():
    from sampler_service.engine import check_parallelism
    from tinkerd.errors import UserError

    check_parallelism(1, 0)
    check_parallelism(4, 4)
    with pytest.raises(UserError, match="needs GPUs; on CPU a replica runs with 1"):
        check_parallelism(2, 0)
    with pytest.raises(UserError, match="this replica sees 2"):
        check_parallelism(4, 2)
    with pytest.raises(UserError, match="at least 1"):
        check_parallelism(0, 1)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_tinkerd_up_exits_at_start_up_on_cpu_with_tensor_parallel(tmp_path):
    """Before any engine or child process starts (and before anything is written): the reason,
    as the exit message. `tinkerd sampler` calls the same check first thing (server.serve)."""
    args = cli.build_parser().parse_args(["up", "--base-model", str(tmp_path), "--state-dir",
                                          str(tmp_path / "state"), "--tensor-parallel-size", "2"])
    with pytest.raises(SystemExit, match="--tensor-parallel-size 2 needs GPUs"):
        up.up(args)
    assert not os.path.exists(tmp_path / "state")


def test_merged_serving_is_on_by_default_in_float32_only():
    """Merged 16-bit weights round a trained adapter's small deltas away (bench/bf16_gap.py), so
    by default only a float32 replica serves hot snapshots merged; a number asks for it anyway."""
    import dataclasses


    base = SamplerSettings(base_model="m")
    assert base.merged_slots == -1
    assert server._merged_slots(base, "float32") == 1
    assert server._merged_slots(base, "bfloat16") == 0 and server._merged_slots(base, "float16") == 0
    assert server._merged_slots(dataclasses.replace(base, merged_slots=2), "bfloat16") == 2
    assert server._merged_slots(dataclasses.replace(base, merged_slots=0), "float32") == 0


def test_tinkerd_up_checks_one_rank_without_importing_torch():
    """`tinkerd up` checks the size before it starts anything; the default, 1, runs anywhere, and
    importing torch to count GPUs cost every `tinkerd up` ~2.5 s of CPU before its children started."""
    import subprocess
    import sys

    code = ("import sys; from launcher import up; up.sampler_server.check_parallelism_or_exit(1); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("command", ["up", "sampler"])
def test_fewer_resident_snapshots_than_active_ones_is_refused_before_anything_starts(tmp_path, command):
    """vLLM refuses max_cpu_loras < max_loras inside its engine start: the sampler died with a
    pydantic traceback in its log, after `up` had started the stack."""
    args = cli.build_parser().parse_args([command, "--base-model", "m", "--state-dir", str(tmp_path / "state"),
                                          "--max-loras", "8", "--max-cpu-loras", "4"])
    with pytest.raises(SystemExit, match="--max-cpu-loras 4 is below --max-loras 8"):
        if command == "up":
            up.up(args)
        else:
            server.serve(settings.from_args(SamplerSettings, args))
    assert not (tmp_path / "state").exists()
    server.check_flags_or_exit(settings.from_args(SamplerSettings, cli.build_parser().parse_args(
        ["sampler", "--base-model", "m", "--max-loras", "4", "--max-cpu-loras", "4"])))


def test_merge_wait_reaches_the_engine_settings_and_a_negative_one_is_refused():
    from sampler_service.engine import MergedSettings

    args = cli.build_parser().parse_args(["sampler", "--base-model", "m", "--merge-wait-s", "2.5"])
    assert settings.from_args(SamplerSettings, args).merge_wait_s == 2.5
    assert MergedSettings(wait_s=0).wait_s == 0
    with pytest.raises(UserError, match="--merge-wait-s must be 0"):
        MergedSettings(wait_s=-1)


@pytest.mark.parametrize("config, tied", [
    ({}, True),                                                 # transformers' default: tied
    ({"tie_word_embeddings": False}, False),
    ({"text_config": None}, True),
    ({"text_config": {"tie_word_embeddings": False}}, False),   # a multimodal config's text model
])
def test_a_merged_slot_unties_the_output_layer_wherever_the_base_model_ties_it(tmp_path, config, tied):
    """The merged slot and the merged export read config.json alike: a delta on lm_head must not
    change the input embeddings of a tied model, a config without the key included."""
    import json

    from sampler_service import merged
    from tinkerd import merged_export

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert merged_export.tied(config) is tied
    assert merged.engine_overrides(str(tmp_path)).get("hf_overrides") == (
        {"tie_word_embeddings": False} if tied else None)
