"""tinker-cookbook 0.6.1 recipes, unmodified, in their own client venv (built once by
scripts/cookbook-venv.sh from the registry, kept outside the clone: harness/client_venvs.py) against `tinkerd up` on the tiny model.

Offline as ../shared/reference/cookbook-offline.md describes: the recipes run in a directory
holding `Qwen/Qwen3.5-9B-Base/` (a link to the tiny model; the server knows the name as an
alias) and JSONL stand-ins for the two hub datasets the minimal loops hard-code.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess

import pytest
from harness.client_venvs import client_venv_root

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = pathlib.Path(__file__).resolve().parents[2]
COOKBOOK_VENV = pathlib.Path(client_venv_root()) / "cookbook-0.6.1"
ALIAS = "Qwen/Qwen3.5-9B-Base"      # the cookbook's default model; model_info maps it to role_colon
ALIAS_CHAT = "Qwen/Qwen3.5-4B"      # the smoke tests' RL model: the qwen3_5 renderer, token-id stops
SMOKE_TESTS = ["tests/recipes/test_recipe_chat_sl.py", "tests/recipes/test_recipe_rolling_checkpoints.py",
               "tests/recipes/test_recipe_math_rl.py"]


@pytest.fixture(scope="module")
def cookbook_python() -> str:
    subprocess.run(["bash", str(REPO / "scripts" / "cookbook-venv.sh")], check=True, timeout=1500,
                   env={**os.environ, "VENV": str(COOKBOOK_VENV)})
    return str(COOKBOOK_VENV / "bin" / "python")


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} + {i % 7}?"},
                          {"role": "assistant", "content": f"{i} + {i % 7} = {i + i % 7}."}]} for i in range(n)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model_dir) -> pathlib.Path:
    """cwd of every recipe: alias dir, dataset stand-ins, an SFT file."""
    root = tmp_path_factory.mktemp("cookbook")
    for name in (ALIAS, ALIAS_CHAT):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(tiny_model_dir, target_is_directory=True)
    _write_jsonl(root / "sft.jsonl", _chats(48))
    # The smoke tests train chat_sl at its default batch size (256) for up to 6 steps.
    for split, n in (("train", 1600), ("test", 4)):
        _write_jsonl(root / "HuggingFaceH4" / "no_robots" / f"{split}.jsonl", _chats(n))
    for split, n in (("train", 32), ("test", 4)):
        _write_jsonl(root / "openai" / "gsm8k" / "main" / f"{split}.jsonl",
                     [{"question": f"What is {i} + 2?", "answer": f"{i} plus 2 is {i + 2}.\n#### {i + 2}"}
                      for i in range(n)])
    # datasets resolves load_dataset("openai/gsm8k", "main") through the card's config list.
    (root / "openai" / "gsm8k" / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
        "  - split: test\n    path: main/test.jsonl\n---\n")
    return root


@pytest.fixture(scope="module")
def cookbook(cookbook_python, workdir, stack):
    """Runs `python -m <recipe> key=value ...` in the work dir against the shared stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "HF_", "MASTER_"))}
    env.update(HF_HOME=str(workdir / "hf-home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TINKER_BASE_URL=stack.url, TINKER_API_KEY=stack.api_key,
               TINKER_TELEMETRY="0", TINKER_COOKBOOK_RUNS_DIR=str(workdir / "runs"), WANDB_MODE="disabled",
               OMP_NUM_THREADS="1")

    def run(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        out = subprocess.run([cookbook_python, "-m", module, *args], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{module} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
        return out
    return run


def _records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _checkpoint_names(log_path: pathlib.Path) -> list[str]:
    records = _records(log_path / "checkpoints.jsonl")
    for r in records:
        assert r.get("state_path", "tinker://").startswith("tinker://"), r
        assert r.get("sampler_path", "tinker://").startswith("tinker://"), r
    return [r["name"] for r in records]


def test_chat_sl_then_resume(cookbook, workdir, tiny_model_dir):
    log = workdir / "runs" / "chat_sl"
    common = [f"model_name={tiny_model_dir}", "renderer_name=role_colon", f"dataset={workdir / 'sft.jsonl'}",
              "batch_size=4", "max_length=512", "lora_rank=8", "learning_rate=1e-3", "save_every=2", "eval_every=0",
              f"log_path={log}"]
    cookbook("tinker_cookbook.recipes.chat_sl.train", *common, "max_steps=4", "behavior_if_log_dir_exists=delete")
    metrics = _records(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    nll = [m["train_mean_nll"] for m in metrics]
    assert all(math.isfinite(x) and x > 0 for x in nll), nll
    assert nll[-1] < nll[0], f"no learning at lr 1e-3: {nll}"
    names = _checkpoint_names(log)
    assert "000002" in names and names[-1] == "final", names
    final = _records(log / "checkpoints.jsonl")[-1]
    assert final["state_path"].startswith("tinker://") and "/weights/" in final["state_path"]
    assert "/sampler_weights/" in final["sampler_path"]

    # A crash after step 3: drop the `final` record and resume to 6 steps from checkpoint 000002
    # (load_weights with optimizer, then get_info on the SDK-derived model id).
    kept = [r for r in _records(log / "checkpoints.jsonl") if r["name"] != "final"]
    _write_jsonl(log / "checkpoints.jsonl", kept)
    cookbook("tinker_cookbook.recipes.chat_sl.train", *common, "max_steps=6", "behavior_if_log_dir_exists=resume")
    resumed = _records(log / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4, 5], [m["step"] for m in resumed]
    assert all(math.isfinite(m["train_mean_nll"]) for m in resumed)
    names = _checkpoint_names(log)
    assert "000004" in names and names[-1] == "final", names


@pytest.mark.parametrize("loss_fn", ["importance_sampling", None])
def test_math_rl_arithmetic(cookbook, workdir, tiny_model_dir, loss_fn):
    """`None` runs the CLI's default loss, stable_reinforce (sequence ids + provenance spans)."""
    log = workdir / "runs" / f"math_rl_{loss_fn or 'default'}"
    cookbook("tinker_cookbook.recipes.math_rl.train", f"model_name={tiny_model_dir}", "renderer_name=role_colon",
             "env=arithmetic", "groups_per_batch=2", "group_size=4", "max_tokens=8", "lora_rank=8", "max_steps=2",
             "eval_every=0", "save_every=1", f"log_path={log}", "behavior_if_log_dir_exists=delete",
             *([f"loss_fn={loss_fn}"] if loss_fn else []))
    steps = [m for m in _records(log / "metrics.jsonl") if "optim/lr" in m]   # (a last line logs the end)
    assert [m["step"] for m in steps] == [0, 1]
    for m in steps:
        assert math.isfinite(m["env/all/reward/total"]) and m["optim/lr"] > 0, m
        # The cookbook's own check that the sampler's logprobs are the trainer's (same weights).
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m
    names = _checkpoint_names(log)
    assert {"000001", "final"} <= set(names), names


def test_sl_loop(cookbook, workdir):
    log = workdir / "runs" / "sl_loop"
    cookbook("tinker_cookbook.recipes.sl_loop", "batch_size=4", "lora_rank=8", "max_steps=3", "save_every=2",
             f"log_path={log}")
    metrics = _records(log / "metrics.jsonl")
    assert len(metrics) == 3 and all(math.isfinite(m["train_mean_nll"]) for m in metrics), metrics
    names = _checkpoint_names(log)
    assert names[-1] == "final" and len(names) >= 2, names


def test_rl_loop(cookbook, workdir):
    """A random model never answers right, so rl_loop skips every update: this covers its
    sampling, sampler snapshots and checkpoints."""
    log = workdir / "runs" / "rl_loop"
    cookbook("tinker_cookbook.recipes.rl_loop", "batch_size=2", "group_size=4", "max_tokens=16", "lora_rank=8",
             "max_steps=2", "save_every=1", "loss_fn=importance_sampling", f"log_path={log}")
    metrics = _records(log / "metrics.jsonl")
    assert len(metrics) == 2, metrics
    names = _checkpoint_names(log)
    assert names[-1] == "final", names


def test_sl_basic_with_a_test_set(cookbook, workdir):
    """The blueprint with a held-out split: each eval samples from a fresh snapshot and scores the
    test set with compute_logprobs."""
    log = workdir / "runs" / "sl_basic"
    cookbook("tinker_cookbook.recipes.sl_basic", "lora_rank=8", "max_steps=3", "save_every=2", "eval_every=1",
             f"log_path={log}", "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
             f"dataset_builder.file_path={workdir / 'sft.jsonl'}", "dataset_builder.test_size=4",
             f"dataset_builder.common_config.model_name_for_tokenizer={ALIAS}",
             "dataset_builder.common_config.renderer_name=role_colon",
             "dataset_builder.common_config.max_length=512", "dataset_builder.common_config.batch_size=4")
    metrics = _records(log / "metrics.jsonl")
    evals = [v for m in metrics for k, v in m.items() if k.startswith("test/") and "nll" in k]
    assert evals and all(math.isfinite(v) for v in evals), metrics
    assert _checkpoint_names(log)[-1] == "final"


def test_the_cookbooks_own_smoke_tests(cookbook_python, workdir, stack):
    """tests/recipes of the tinker-cookbook 0.6.1 sdist, unmodified: chat_sl and its resume, rolling
    checkpoints and their resume, math_rl sync / async (off-policy) / stream-minibatch. They run
    recipes with `uv run`; a two-line shim runs them with the cookbook venv's python instead."""
    sdist_dir = COOKBOOK_VENV / "sdist"
    if not (sdist_dir / "tests" / "recipes").is_dir():
        subprocess.run([cookbook_python, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                        "-d", str(sdist_dir), "tinker-cookbook==0.6.1"], check=True, timeout=300)
        subprocess.run(["tar", "xzf", "tinker_cookbook-0.6.1.tar.gz", "--strip-components=1",
                        "tinker_cookbook-0.6.1/tests"], cwd=sdist_dir, check=True)
    tests = workdir / "tests"
    if not tests.exists():
        tests.symlink_to(sdist_dir / "tests", target_is_directory=True)
    shim = workdir / "shim" / "uv"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text('#!/bin/sh\n[ "$1" = run ] && shift\nexec "$@"\n')
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "HF_", "MASTER_", "PYTEST_"))}
    env.update(HF_HOME=str(workdir / "hf-home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TINKER_BASE_URL=stack.url, TINKER_API_KEY=stack.api_key,
               TINKER_TELEMETRY="0", TINKER_COOKBOOK_RUNS_DIR=str(workdir / "runs"), WANDB_MODE="disabled",
               OMP_NUM_THREADS="1", SMOKE_TEST_TIMEOUT="600",
               PATH=f"{shim.parent}:{pathlib.Path(cookbook_python).parent}:{os.environ['PATH']}")
    out = subprocess.run([cookbook_python, "-m", "pytest", "-p", "no:cacheprovider", "-q", *SMOKE_TESTS],
                         cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-3000:]
    assert "7 passed" in out.stdout, out.stdout[-3000:]
