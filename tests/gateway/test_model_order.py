"""gateway/futures/order.py: a model's jobs start in seq_id order; the next step is sent while
one runs (the trainer holds it in the model's order), anything else runs alone."""

import asyncio

import pytest

from gateway.futures.order import IN_FLIGHT, ModelOrder


class Trainer:
    """Jobs that each run until released, recording when they start and end."""

    def __init__(self):
        self.log: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    def job(self, name: str):
        self.release[name] = asyncio.Event()

        async def run():
            self.log.append(f"start {name}")
            await self.release[name].wait()
            self.log.append(f"end {name}")
            return "application/json", b"{}"
        return run

    async def finish(self, name: str) -> None:
        self.release[name].set()
        await _settle()


async def _nowhere(key: str) -> bool:
    return False          # no other gateway


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def _put(order: ModelOrder, trainer: Trainer, seq: int, name: str, kind: str) -> asyncio.Task:
    """As the job engine does (gateway/jobs/engine.py): the turn taken now, the job run in a task in it."""
    turn, job = order.put("m", seq, name, kind), trainer.job(name)

    async def run():
        async with turn:
            await job()
    return asyncio.create_task(run())


def _order(trainer: Trainer, requests: list[tuple[int, str, str]]) -> ModelOrder:
    order = ModelOrder(_nowhere)
    for seq, name, kind in requests:
        _put(order, trainer, seq, name, kind)
    return order


def test_the_next_step_is_sent_while_one_runs_and_a_creation_runs_alone():
    async def scenario():
        trainer = Trainer()
        order = _order(trainer, [(0, "create", "create_model"), (1, "fb1", "forward_backward"),
                                 (2, "step2", "optim_step"), (3, "fb3", "forward_backward")])
        await _settle()
        assert trainer.log == ["start create"]          # the model's creation alone
        assert order.position("m", "fb1") == (False, 1)
        await trainer.finish("create")
        # Its next step goes while it runs, no further: IN_FLIGHT steps at once.
        assert IN_FLIGHT == 2 and trainer.log[1:] == ["end create", "start fb1", "start step2"]
        # The step sent early waits at the trainer behind the one that runs, and says so.
        assert order.position("m", "fb1") == (True, 0) and order.position("m", "step2") == (False, 1)
        assert order.position("m", "fb3") == (False, 2)
        await trainer.finish("fb1")
        assert trainer.log[4:] == ["end fb1", "start fb3"]
        await trainer.finish("step2")
        await trainer.finish("fb3")
        assert trainer.log[-2:] == ["end step2", "end fb3"]
        order.stop()
    asyncio.run(scenario())


def test_a_step_free_to_run_starts_as_it_is_put_not_a_turn_of_the_event_loop_later():
    """The route that puts a step answers its client in the same turn; in the turns after it the
    gateway handles that client's next requests. A runner woken by an event would send the step
    to the trainer only after those (on 2 cores, ~0.5 ms later a step: docs/benchmarks.md)."""
    async def scenario():
        trainer = Trainer()
        order = _order(trainer, [(1, "fb1", "forward_backward")])
        assert order.position("m", "fb1") == (True, 0)      # running before this coroutine yields
        await asyncio.sleep(0)
        assert trainer.log == ["start fb1"]
        _put(order, trainer, 2, "step2", "optim_step")     # the next step, while one runs
        await asyncio.sleep(0)
        assert trainer.log == ["start fb1", "start step2"]
        _put(order, trainer, 4, "fb4", "forward_backward")   # after a gap: held
        await _settle()
        assert trainer.log == ["start fb1", "start step2"] and order.position("m", "fb4") == (False, 2)
        order.stop()
    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["save_weights_for_sampler", "save_weights", "refused"])
def test_a_request_that_is_not_a_step_waits_for_the_steps_and_runs_alone(kind):
    async def scenario():
        trainer = Trainer()
        order = _order(trainer, [(1, "fb1", "forward_backward"), (2, "other", kind), (3, "fb3", "forward_backward")])
        await _settle()
        assert trainer.log == ["start fb1"]
        await trainer.finish("fb1")
        assert trainer.log[1:] == ["end fb1", "start other"]
        await trainer.finish("other")
        assert trainer.log[3:] == ["end other", "start fb3"]
        await trainer.finish("fb3")
        order.stop()
    asyncio.run(scenario())


def test_a_step_after_a_gap_is_not_sent_early():
    """seq 3 while 1 runs and 2 has not arrived: 3 waits for 1 to end and for 2 (the gap's wait)."""
    async def scenario():
        trainer = Trainer()
        order = _order(trainer, [(1, "fb1", "forward_backward"), (3, "fb3", "forward_backward")])
        await _settle()
        assert trainer.log == ["start fb1"]
        await trainer.finish("fb1")
        assert trainer.log == ["start fb1", "end fb1"]        # 3 waits for 2 (up to the gap timeout)
        _put(order, trainer, 2, "step2", "optim_step")
        await asyncio.sleep(0.05)
        await _settle()
        assert trainer.log[2:] == ["start step2", "start fb3"]
        await trainer.finish("step2")
        await trainer.finish("fb3")
        order.stop()
    asyncio.run(scenario())


def test_a_late_lower_seq_id_starts_while_a_higher_one_runs():
    """seq 5 was another gateway's (so 6 went on to the trainer, which holds it for 5), and comes
    here late, re-driven after that gateway stopped: it starts at once, not after 6 ends (6 waits
    in the trainer for it: they would wait on each other until the trainer's gap timeout, then
    run out of order). Seen: test_multi_host's database partition, steps 3 and 2 in that order."""
    async def elsewhere(key: str) -> bool:
        return key == "m#5"

    async def scenario():
        trainer = Trainer()
        order = ModelOrder(elsewhere)
        _put(order, trainer, 4, "fb4", "forward_backward")
        await trainer.finish("fb4")
        _put(order, trainer, 6, "fb6", "forward_backward")
        await asyncio.sleep(0.01)
        await _settle()
        assert trainer.log[2:] == ["start fb6"]              # 5 is elsewhere: 6 goes on
        _put(order, trainer, 5, "step5", "optim_step")       # re-driven here
        await _settle()
        assert trainer.log[3:] == ["start step5"]
        await trainer.finish("step5")
        await trainer.finish("fb6")
        order.stop()
    asyncio.run(scenario())


def test_forgetting_a_model_cancels_its_running_steps():
    async def scenario():
        trainer = Trainer()
        order = _order(trainer, [(1, "fb1", "forward_backward"), (2, "step2", "optim_step")])
        await _settle()
        assert trainer.log == ["start fb1", "start step2"]
        order.forget("m")
        await _settle()
        assert trainer.log == ["start fb1", "start step2"] and order.position("m", "fb1") == (False, 0)
        assert order.drop_idle(0) == 0
    asyncio.run(scenario())
