"""Where things live under a state dir, derived from ids and names only: the one layout that the
gateway, trainer and sampler share. No service takes a directory from a caller; each derives it
here under its own state dir, so no request can make a service read, write or delete elsewhere.

    <state_dir>/checkpoints/<dir_name(run)>/<kind>/<name>   save_state, external, copies
    <state_dir>/snapshots/<dir_name(snapshot_id)>            persisted sampler snapshots
    <state_dir>/models/<dir_name(model_id)>                  a model's durable state (trainer_service/durable.py)
"""

from __future__ import annotations

import os
import re

from tinkerd.errors import UserError

_UNSAFE = re.compile(r"[^A-Za-z0-9_.@-]")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")

CHECKPOINT_KINDS = ("weights", "sampler_weights", "external_weights")
CHECKPOINTS, SNAPSHOTS, MODELS = "checkpoints", "snapshots", "models"


def dir_name(identifier: str) -> str:
    """`sess-1:train:0@3-ab` -> `sess-1_train_0@3-ab`: one path component, no separators, never
    `.`, `..` or hidden (a leading dot becomes `_`)."""
    if not identifier:
        raise UserError("an id is required")
    safe = _UNSAFE.sub("_", identifier)
    return "_" + safe[1:] if safe.startswith(".") else safe


def checked_name(name) -> str:
    """A checkpoint name as one plain path component: [A-Za-z0-9_.-], not starting with a dot
    (so never `.`, `..`, empty, a separator or NUL)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith("."):
        raise UserError(f"checkpoint name {name!r} must match [A-Za-z0-9_.-]{{1,255}} and not start with '.'")
    return name


def contained(root: str, path: str) -> str:
    """`path` resolved (symlinks too), refused unless it lies strictly below `root`."""
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        raise UserError(f"{path!r} is outside {root}")
    return real


def checkpoint_dir(state_dir: str, run_id: str, kind: str, name: str) -> str:
    if kind not in CHECKPOINT_KINDS:
        raise UserError(f"checkpoint kind {kind!r} must be one of {CHECKPOINT_KINDS}")
    root = os.path.join(state_dir, CHECKPOINTS)
    path = os.path.join(root, dir_name(run_id), kind, checked_name(name))
    contained(root, path)
    return path


def snapshot_dir(state_dir: str, snapshot_id: str) -> str:
    root = os.path.join(state_dir, SNAPSHOTS)
    path = os.path.join(root, dir_name(snapshot_id))
    contained(root, path)
    return path


def model_dir(state_dir: str, model_id: str) -> str:
    root = os.path.join(state_dir, MODELS)
    path = os.path.join(root, dir_name(model_id))
    contained(root, path)
    return path


def adapter_path(state_dir: str, path: str) -> str:
    """A persisted adapter path another service handed on (a snapshot or a sampler checkpoint),
    accepted only below this state dir's snapshots/ or checkpoints/."""
    for sub in (SNAPSHOTS, CHECKPOINTS):
        try:
            return contained(os.path.join(state_dir, sub), path)
        except UserError:
            continue
    raise UserError(f"{path!r} is not a snapshot or checkpoint of this service's state dir")
