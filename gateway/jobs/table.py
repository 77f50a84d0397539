"""Every job, by the request type it runs: the one list (gateway/app.py hands it to the job engine)."""

from __future__ import annotations

from gateway.jobs.base import Job
from gateway.jobs.custom_losses import CreateCustomLoss
from gateway.jobs.sampling import Sample
from gateway.jobs.service import Noop, UnloadModel
from gateway.jobs.training import CreateModel, ForwardBackward, OptimStep, Refused
from gateway.jobs.weights import LoadWeights, PushWeights, SaveState

JOB_CLASSES: tuple[type[Job], ...] = (CreateModel, ForwardBackward, OptimStep, Refused, PushWeights, SaveState,
                                      LoadWeights, Sample, UnloadModel, Noop, CreateCustomLoss)
JOBS: dict[str, type[Job]] = {kind: cls for cls in JOB_CLASSES for kind in cls.kinds}
