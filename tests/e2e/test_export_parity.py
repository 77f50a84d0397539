"""Adapters that serve anywhere (issue 26): a checkpoint trained through the SDK and downloaded
as its archive loads, unchanged, in PEFT and in vanilla vLLM's LoRA path, and its merged export
(`?format=merged`) loads as a plain model in transformers and vLLM; every one gives per-position
logprobs within float32's tolerance of tinkerd's own sampler (`compute_logprobs`). The same on a
base that ties lm_head to its embeddings (the tiny model does not), without a stack.

The loaders run in subprocesses (export_loaders.py), with nothing of tinkerd. SmolLM2 (a base
that ties lm_head to the embeddings, stored in bfloat16) runs where `tinkerd fetch-smollm2
models/smollm2` has been run, and is skipped elsewhere."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e

LOADERS = pathlib.Path(__file__).with_name("export_loaders.py")
TEXTS = ["alpha beta gamma delta epsilon", "the dog and the red ball ran", "one two three four five six"]
FP32_TOL = 1e-4


def _download(stack, tinker_path: str, out: pathlib.Path, **params) -> pathlib.Path:
    """The checkpoint's archive (through the signed link the archive route redirects to), extracted."""
    run_id, checkpoint_id = tinker_path.removeprefix("tinker://").split("/", 1)
    headers = {"X-API-Key": stack.api_key}
    redirect = httpx.get(f"{stack.url}/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/archive",
                         params=params, headers=headers, follow_redirects=False, timeout=60)
    assert redirect.status_code == 302, redirect.text
    got = httpx.get(redirect.headers["location"], timeout=600)
    assert got.status_code == 200, got.text
    with tarfile.open(fileobj=io.BytesIO(got.content)) as tar:
        tar.extractall(out, filter="data")
    return out


def _load(jobs: list[tuple[str, object, object]], prompts: list[list[int]]) -> list[list[np.ndarray]]:
    """Each (loader, base dir, export dir)'s logprobs of the prompts, all loaded in one subprocess."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    jobs_json = json.dumps([[loader, str(base), str(export)] for loader, base, export in jobs])
    done = subprocess.run([sys.executable, str(LOADERS), jobs_json, json.dumps(prompts)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=str(LOADERS.parent))
    assert done.returncode == 0, done.stderr[-4000:]
    return [[np.array(lp) for lp in job] for job in json.loads(done.stdout.strip().splitlines()[-1])]


def _worst(got: list[np.ndarray], expected: list[np.ndarray]) -> float:
    assert [len(g) for g in got] == [len(e) for e in expected]
    return max(float(np.max(np.abs(g - e))) for g, e in zip(got, expected))


def _trained(stack, base_dir: str, tmp: pathlib.Path, steps: int):
    """A rank-8 adapter (attention, MLP and lm_head: Tinker's defaults) trained `steps` steps;
    its sampler checkpoint, its state checkpoint, prompts, and tinkerd's logprobs of them."""
    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=base_dir, rank=8, seed=26).result()
    tok = tc.get_tokenizer()
    data = sft_data(tok, TEXTS)
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler_path = tc.save_weights_for_sampler("export").result().path
    state_path = tc.save_state("export").result().path
    prompts = [tok.encode(t) for t in (*TEXTS, "the cat sat on a mat in the red ball")]
    sampler = service.create_sampling_client(model_path=sampler_path)
    expected = [np.array(sampler.compute_logprobs(types.ModelInput.from_ints(p)).result()[1:]) for p in prompts]
    base = service.create_sampling_client(base_model=base_dir)
    untrained = [np.array(base.compute_logprobs(types.ModelInput.from_ints(p)).result()[1:]) for p in prompts]
    assert _worst(untrained, expected) > 1e-2          # the adapter matters to these logprobs
    service.close("success").result()
    return sampler_path, state_path, prompts, expected


@pytest.fixture(scope="module")
def trained(stack, tiny_model_dir, tmp_path_factory):
    return _trained(stack, tiny_model_dir, tmp_path_factory.mktemp("export"), steps=3)


def test_the_archive_loads_unchanged_in_peft_and_vanilla_vllm(stack, tiny_model_dir, trained, tmp_path):
    sampler_path, state_path, prompts, expected = trained
    sampler_dir = _download(stack, sampler_path, tmp_path / "sampler")
    state_dir = _download(stack, state_path, tmp_path / "state")
    assert "?format=merged" in (sampler_dir / "TINKERD_EXPORT.md").read_text()    # it trains lm_head
    assert "lm_head" in json.loads((sampler_dir / "adapter_config.json").read_text())["target_modules"]
    peft_sampler, peft_state, vllm_lora = _load([("peft", tiny_model_dir, sampler_dir), ("peft", tiny_model_dir, state_dir),
                                                 ("vllm-lora", tiny_model_dir, sampler_dir)], prompts)
    assert _worst(peft_sampler, expected) < FP32_TOL
    assert _worst(peft_state, expected) < FP32_TOL
    assert _worst(vllm_lora, expected) < FP32_TOL


def test_the_merged_archive_loads_as_a_plain_model(stack, tiny_model_dir, trained, tmp_path):
    sampler_path, _, prompts, expected = trained
    merged = _download(stack, sampler_path, tmp_path / "merged", format="merged")
    assert "Why a merged export" in (merged / "TINKERD_EXPORT.md").read_text()
    hf_merged, vllm_merged = _load([("hf-merged", tiny_model_dir, merged), ("vllm-merged", tiny_model_dir, merged)],
                                   prompts)
    assert _worst(hf_merged, expected) < FP32_TOL
    assert _worst(vllm_merged, expected) < FP32_TOL


def _tied_copy(model_dir: str, out: pathlib.Path, dtype: str = "float32") -> pathlib.Path:
    """The tiny model with lm_head tied to its embeddings (as SmolLM2, Llama 3.2 1B/3B, Qwen 0.5-3B are),
    stored in `dtype`."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(out)
    for f in pathlib.Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def test_a_tied_base_takes_the_lm_head_adapter_and_its_merged_export(tiny_model_dir, tmp_path):
    """Without a stack: an adapter as tinkerd exports one (every projection and lm_head, random B)
    on a tied base, through the merged archive's own code; vLLM's LoRA path and the merged model
    (its lm_head untied) against PEFT, in float32."""
    from gateway import export
    from harness.models import build_lora_adapter

    base = _tied_copy(tiny_model_dir, tmp_path / "tied")
    adapter = build_lora_adapter(base, tmp_path / "adapter", rank=8, seed=3, std=0.05)
    row = type("Row", (), {"directory": str(adapter), "tinker_path": "tinker://r:train:0/sampler_weights/x"})()
    archive = export.merged_archive(str(base), row)
    blob = b"".join(archive.chunks())
    assert len(blob) == archive.size
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(tmp_path / "merged", filter="data")
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False

    prompts = [[5, 17, 300, 42, 9, 88, 120, 7], [11, 12, 13, 14, 15, 16], [900, 4, 60, 61, 62, 63, 64, 65, 66]]
    expected, vllm_lora, vllm_merged = _load([("peft", base, adapter), ("vllm-lora", base, adapter),
                                              ("vllm-merged", base, tmp_path / "merged")], prompts)
    assert _worst(vllm_lora, expected) < FP32_TOL
    assert _worst(vllm_merged, expected) < FP32_TOL


def test_a_tied_bf16_base_through_the_stack(start_stack, tiny_model_dir, tmp_path):
    """A base like SmolLM2: lm_head tied to its embeddings, stored in bfloat16; the stack runs
    float32. The adapter trained through the SDK loads in PEFT and vLLM within float32's tolerance;
    the merged export (bfloat16, its lm_head untied) within bfloat16's rounding of the merged
    weights. (It ran on SmolLM2 itself, 128 s of the suite; the tiny model has the same traits.)"""
    base = _tied_copy(tiny_model_dir, tmp_path / "tied", "bfloat16")
    with start_stack(str(base), tmp_path / "state") as stack:
        sampler_path, _, prompts, expected = _trained(stack, str(base), tmp_path, steps=1)
        adapter = _download(stack, sampler_path, tmp_path / "adapter")
        merged = _download(stack, sampler_path, tmp_path / "merged", format="merged")
    config = json.loads((merged / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    peft, vllm_lora, vllm_merged = _load([("peft", base, adapter), ("vllm-lora", base, adapter),
                                          ("vllm-merged", base, merged)], prompts)
    assert _worst(peft, expected) < FP32_TOL
    assert _worst(vllm_lora, expected) < FP32_TOL
    assert _worst(vllm_merged, expected) < 0.1
