"""Run by test_ranks.py under torchrun with 2 ranks: a forward_backward that fails on rank
`FAILING` alone, inside the call (its micro-step raises), while the other rank goes on into the
call's collectives. Rank 0 prints what its caller got and how soon.

    python -m torch.distributed.run --nproc-per-node 2 tests/trainer/ranks_fault_job.py MODEL STATE FAILING
"""

import os
import sys
import time

from tinkerd.process import exit_now
from trainer_service import training
from trainer_service.durable import DurableModels
from trainer_service.engine import TrainerEngine
from trainer_service.lora import LoraSpec

from ranks_job import batch


def main(model_dir: str, state_dir: str, failing: str) -> None:
    engine = TrainerEngine(model_dir, zero_stage=0, durable=DurableModels(state_dir))
    if os.environ["RANK"] == failing:
        def fail(*args, **kwargs):
            raise RuntimeError(f"injected failure on rank {failing}")
        training._micro_step = fail
    if not engine.ranks.leader:
        engine.ranks.follow(engine)
        exit_now()
    engine.create_model("m", LoraSpec(rank=4, seed=7))
    t0 = time.monotonic()
    try:
        engine.forward_backward("m", batch(), "cross_entropy", {}, forward_only=False)
        print("CALLER ok", flush=True)
    except Exception as e:  # noqa: BLE001 - what the servicer would answer with
        print(f"CALLER {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    time.sleep(30)       # the broken job's own exit (ranks.py: EXIT_AFTER_S) comes first
    exit_now()


if __name__ == "__main__":
    main(*sys.argv[1:])
