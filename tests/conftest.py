"""Shared fixtures: a tiny model built locally, and a running `tinkerd up` on it."""

from __future__ import annotations

import os

import pytest

from harness.stack import running_stack

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_API_KEY", "tml-local-tests")
os.environ.setdefault("TINKER_TELEMETRY", "0")

# Test files that run vLLM or DeepSpeed inside the pytest process: both keep process-wide
# torch.distributed state (vLLM tears its group down, DeepSpeed caches its groups), so under
# pytest-xdist (scripts/test.sh) they share one worker and run in collection order, as in one
# process. They go first, the longest group, so the other worker has the rest meanwhile. Every
# other file is its own group, so its module-scoped stack starts once; each benchmark's smoke
# test is a group of its own.
IN_PROCESS_ENGINES = ("tests/sampler/", "tests/trainer/")
ONE_PROCESS_PER_TEST = ("tests/bench/",)       # each runs a benchmark in a process of its own


def pytest_collection_modifyitems(config, items):
    def in_process(item) -> bool:
        return item.nodeid.startswith(IN_PROCESS_ENGINES)
    for item in items:
        if in_process(item):
            group = "in-process-engines"
        elif item.nodeid.startswith(ONE_PROCESS_PER_TEST):
            group = item.nodeid          # no shared fixture to keep: each test is its own unit
        else:
            group = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: not in_process(item))      # stable: collection order otherwise


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from harness.models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(scope="session")
def stack(tiny_model_dir, tmp_path_factory):
    """The shared `tinkerd up` on the tiny model, with default settings."""
    # Dozens of test modules share it under one admin key: the per-user run limit is raised for them.
    with running_stack(tiny_model_dir, tmp_path_factory.mktemp("state"), "--alias", "tiny/alias-model",
                       "--alias", "Qwen/Qwen3.5-9B-Base", "--alias", "Qwen/Qwen3.5-4B",
                       "--max-models-per-user", "1000") as s:
        yield s


@pytest.fixture(scope="session")
def start_stack():
    """For tests that need a stack with other settings: `with start_stack(model, state, *flags)`."""
    return running_stack


def sft_data(tok, texts):
    """One next-token datum per text (weights 1), as SDK types. Test modules import it:
    `from conftest import sft_data`."""
    from tinker import types

    out = []
    for text in texts:
        t = tok.encode(text)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                               loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)}))
    return out
