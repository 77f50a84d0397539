"""Typed durable jobs (gateway/jobs/): every request kind has one job class, listed in one table;
each one's stored form (what a future's row keeps) gives the same job back, so a re-drive on
another gateway runs exactly what was submitted."""

from __future__ import annotations

import dataclasses
import typing

from gateway.jobs.base import Job, Owner, StoredRequest
from gateway.jobs.custom_losses import CreateCustomLoss
from gateway.jobs.sampling import Sample, SampleOf
from gateway.jobs.service import Noop, UnloadModel
from gateway.jobs.table import JOB_CLASSES, JOBS
from gateway.jobs.training import CreateModel, ForwardBackward, NewRun, OptimStep, Refused
from gateway.jobs.weights import LoadWeights, PushWeights, SaveState
from tinkerd.v1 import sampler_pb2, trainer_pb2

OWNER = Owner("user-1", "org-1")
RUN = NewRun("s:train:0", "s", "user-1", "tiny", 8, {"rank": 8})


def _examples() -> list[Job]:
    fb = trainer_pb2.ForwardBackwardRequest(model_id="s:train:0", seq_id=3, loss_fn="cross_entropy")
    return [
        CreateModel(trainer_pb2.CreateModelRequest(model_id="s:train:0", base_model="tiny"), OWNER, RUN),
        ForwardBackward(fb),
        ForwardBackward(trainer_pb2.ForwardBackwardRequest(model_id="s:train:0", seq_id=4, forward_only=True)),
        OptimStep(trainer_pb2.OptimStepRequest(model_id="s:train:0", seq_id=5)),
        Refused("s:train:0", 6, "datum 0: loss_fn_inputs['weights'] has shape [3], expected leading dimension 4"),
        PushWeights(trainer_pb2.PushWeightsRequest(model_id="s:train:0", seq_id=6, snapshot_id="x"), OWNER, "s",
                    "tiny", None, "s:sample:1", None),
        PushWeights(trainer_pb2.PushWeightsRequest(model_id="s:train:0", seq_id=9, snapshot_id="y"), OWNER, "s",
                    "tiny", None, "s:sample:2", None, True),
        SaveState(trainer_pb2.SaveStateRequest(model_id="s:train:0", seq_id=7, kind="external_weights", name="a"),
                  OWNER, "tinker://s:train:0/weights/a", "training", "2026-11-25T00:00:00+00:00", {"k": "v"},
                  "save_weights_external"),
        LoadWeights(trainer_pb2.CreateModelRequest(model_id="s:train:1"), OWNER, 0, "tinker://r/weights/a", RUN),
        LoadWeights(trainer_pb2.CreateModelRequest(model_id="s:train:0"), OWNER, 9, "tinker://r/weights/a", None),
        Sample(sampler_pb2.SampleRequest(request_id="r1"), "s"),
        Sample(sampler_pb2.SampleRequest(request_id="r2")),
        Sample(sampler_pb2.SampleRequest(request_id="r3"), None, SampleOf("user-1", "s", "tiny")),
        UnloadModel("s:train:0"),
        Noop(),
        CreateCustomLoss("s:loss:0", "s", OWNER, "ppo", '{"name": "ppo"}', "ab" * 32),
        ForwardBackward(trainer_pb2.ForwardBackwardRequest(
            model_id="s:train:0", seq_id=8, loss_fn="custom",
            custom_loss=trainer_pb2.CustomLoss(loss_id="s:loss:0", spec_json='{"name": "ppo"}'))),
    ]


def test_every_job_comes_back_from_its_stored_form():
    examples = _examples()
    assert {type(job) for job in examples} == set(JOB_CLASSES)
    for job in examples:
        stored = job.stored()
        assert isinstance(stored.body, bytes) and "message" not in stored.args
        again = JOBS[job.kind()].from_stored(StoredRequest(stored.args, stored.body))
        assert again == job, job
    assert ForwardBackward(trainer_pb2.ForwardBackwardRequest(forward_only=True)).kind() == "forward"
    assert examples[7].kind() == "save_external_weights"


def test_job_arguments_are_typed():
    """No untyped `args` dict: every argument is a declared field of a plain or dataclass type."""
    for cls in JOB_CLASSES:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert hints[f.name] not in (dict, typing.Any) or f.name in ("user_metadata", "lora_config"), (cls, f)
        for kind in cls.kinds:
            assert JOBS[kind] is cls


def test_a_row_in_another_shape_is_not_run():
    """A row an older gateway stored (other argument names) is refused, not run with guesses."""
    import pytest

    with pytest.raises(KeyError):
        CreateModel.from_stored(StoredRequest({"caller": {"user_id": "u", "org_id": "o"}, "run": {}}, b""))


def test_a_row_from_before_an_argument_with_a_default_runs_with_the_default():
    """A save_weights_for_sampler stored before `inflight` existed is re-driven as a snapshot save."""
    job = PushWeights(trainer_pb2.PushWeightsRequest(model_id="s:train:0", seq_id=6, snapshot_id="x"), OWNER, "s",
                      "tiny", None, "s:sample:1", None)
    stored = job.stored()
    del stored.args["inflight"]
    assert PushWeights.from_stored(stored) == job and not job.inflight
