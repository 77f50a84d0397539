"""bench/allocator.py: the trainer's RL step measured under each allocator in a process of its
own; what the trainer's tcmalloc preload (tinkerd/process.py) is for: fewer page faults a step."""

import pytest

from bench import allocator


@pytest.mark.tcmalloc
def test_each_allocator_runs_in_its_own_process_and_tcmalloc_faults_less():
    # Logits over 32 MiB, as a real model's: smaller blocks glibc learns to keep (its mmap threshold
    # rises as they are freed), and a step of the plain tiny model once faulted 4 pages under glibc.
    results = {name: [allocator.run_child(name, "tiny-wide-vocab", "float32", steps=2)]
               for name in allocator.ALLOCATORS}
    for runs in results.values():          # run_child checked each child ran the allocator it names
        steps = runs[0]["steps"]
        assert len(steps) == 2 and all(s["s"] > 0 for s in steps)
    faults = {name: min(s["faults"] for s in runs[0]["steps"]) for name, runs in results.items()}
    assert faults["tcmalloc"] < faults["glibc malloc"], faults
    table = allocator.render(results, "tiny-wide-vocab", "float32")
    assert "| glibc malloc |" in table and "| tcmalloc |" in table and "glibc / tcmalloc step" in table
