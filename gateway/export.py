"""What a checkpoint archive holds besides the checkpoint's own files: TINKERD_EXPORT.md, which
says how to load the adapter elsewhere and when to take the merged export instead; and the
merged export itself (`?format=merged`: tinkerd/merged_export.py), a full model directory."""

from __future__ import annotations

import datetime
import json
import os
import secrets
import threading
import time
import weakref
from typing import Iterator

from gateway import checkpoints
from gateway.checkpoints import Member, bytes_member, file_member
from gateway.identity.limits import Limits, OverLimit
from gateway.storage.db import CheckpointRow, Database, ExportPlaceRow, now
from tinkerd import merged_export

FORMATS = ("peft", "merged")


def _mtime(row: CheckpointRow) -> int:
    return int(os.stat(row.directory).st_mtime)


def _adapter_config(row: CheckpointRow) -> dict:
    try:
        with open(os.path.join(row.directory, "adapter_config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}          # the notes say less; the archive is still the checkpoint's files


def adapter_notes(row: CheckpointRow) -> Member:
    """TINKERD_EXPORT.md of the PEFT archive."""
    config = _adapter_config(row)
    targets = sorted(config.get("target_modules") or [])
    unembed = "lm_head" in targets
    text = (f"# {row.tinker_path}\n\n"
            f"A LoRA adapter in PEFT format (`adapter_config.json`, `adapter_model.safetensors`): rank "
            f"{config.get('r')}, alpha {config.get('lora_alpha')}, on {', '.join(targets) or '?'}. "
            "`tinkerd_state.json` and `optimizer/` (full-state checkpoints) are tinkerd's own; other "
            "tools ignore them.\n\n"
            "Load it as it is:\n\n"
            "- PEFT: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), this_dir)`\n"
            "- vLLM: `LLM(model=base, enable_lora=True, max_lora_rank=...)` and "
            "`LoRARequest(name, 1, this_dir)` per request.\n\n"
            + ("This adapter trains the output layer (`lm_head`, train_unembed). vLLM serves that for "
               "architectures declaring an lm_head LoRA (Llama, Qwen3, Granite among them) and refuses the "
               "adapter for others (Qwen2, Gemma 2/3, Phi-3). For those, or for any server without LoRA "
               "support, download the merged export: the same archive URL with `?format=merged` (a full "
               "model with the adapter merged into its weights; its own TINKERD_EXPORT.md says how).\n"
               if unembed else
               "Any server with LoRA support for these modules takes it; `?format=merged` on the archive "
               "URL gives the full model with the adapter merged into its weights.\n"))
    return bytes_member(merged_export.NOTES, text.encode(), _mtime(row))


def peft_archive(row: CheckpointRow) -> checkpoints.Tar:
    return checkpoints.archive(row.directory, [adapter_notes(row)])


def merged_plan(base_model_dir: str, row: CheckpointRow) -> merged_export.Plan:
    """The merged export of the checkpoint, checked (a UserError where it cannot be made)."""
    return merged_export.plan(base_model_dir, row.directory)


# Merging takes the gateway's CPU and, per download, a few ROWS_BYTES blocks of memory: at most
# this many are made at once on a gateway, and one per checkpoint owner on all the gateways
# together (two slow downloads of one user's checkpoints must not block everyone's); another
# download meanwhile is a 429.
MAX_MERGED_EXPORTS = 2
MAX_MERGED_EXPORTS_PER_OWNER = 1
# An owner's place is a database row (Limits.admit_export) with a lease its stream renews as it
# sends: a download whose gateway went away, or stalled this long, no longer holds it.
PLACE_LEASE_S = 120.0
_RENEW_S = 30.0
_merging: weakref.WeakSet = weakref.WeakSet()    # this gateway's places: one dropped unread frees its place
_merging_lock = threading.Lock()


def merged_archive(base_model_dir: str, row: CheckpointRow) -> checkpoints.Tar:
    """The merged export's tar, laid out: nothing is merged until its chunks are read, through
    a Place's `stream`."""
    return _merged_tar(base_model_dir, merged_plan(base_model_dir, row), row)


def take_place(limits: Limits, owner: str | None) -> "Place":
    """A place to make a merged export of `owner`'s checkpoint (blocking: the database, so in a
    thread); an OverLimit where MAX_MERGED_EXPORTS are being made on this gateway already, or
    MAX_MERGED_EXPORTS_PER_OWNER of the owner's on any."""
    with _merging_lock:
        if len(_merging) >= MAX_MERGED_EXPORTS:
            raise OverLimit(f"{len(_merging)} merged exports are being made on this gateway (the limit is "
                            f"{MAX_MERGED_EXPORTS}); retry when one has finished", retry_after_s=30)
        place = Place(limits.db, owner or "")
        _merging.add(place)
    try:
        row = ExportPlaceRow(place_id=place.place_id, owner=place.owner, lease_until=place.lease_end())
        limits.db.add_admitted(row, limits.admit_export(place.owner, MAX_MERGED_EXPORTS_PER_OWNER))
    except BaseException:
        with _merging_lock:
            _merging.discard(place)
        raise
    place.held = weakref.finalize(place, _release_apart, limits.db, place.place_id)
    return place


class Place:
    """A merged export's place: `stream` counts its chunks as being made until they end (sent,
    failed, or dropped unread: then the place is freed when the stream is collected)."""

    def __init__(self, db: Database, owner: str):
        self.db, self.owner = db, owner
        self.place_id = secrets.token_hex(16)
        self.held: weakref.finalize | None = None
        self._chunks: Iterator[bytes] = iter(())
        self._renew_at = time.monotonic() + _RENEW_S

    @staticmethod
    def lease_end():
        return now() + datetime.timedelta(seconds=PLACE_LEASE_S)

    def stream(self, chunks: Iterator[bytes]) -> "Place":
        self._chunks = chunks
        return self

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        try:
            chunk = next(self._chunks)
        except BaseException:
            self.release()
            raise
        if time.monotonic() >= self._renew_at:        # starlette reads a sync stream in a thread
            self._renew_at = time.monotonic() + _RENEW_S
            self.db.touch(ExportPlaceRow, self.place_id, lease_until=self.lease_end())
        return chunk

    def release(self) -> None:
        """Frees the place now (blocking: the database)."""
        with _merging_lock:
            _merging.discard(self)
        if self.held is not None and self.held.detach() is not None:
            _release(self.db, self.place_id)


def _release(db: Database, place_id: str) -> None:
    db.delete(ExportPlaceRow, place_id)


def _release_apart(db: Database, place_id: str) -> None:
    """A place dropped unread (a client gone before the first chunk) is collected wherever the
    last reference went, perhaps on the event loop: its row is deleted in a thread of its own."""
    threading.Thread(target=_release, args=(db, place_id), name="export-place", daemon=True).start()


def _merged_tar(base_model_dir: str, plan: merged_export.Plan, row: CheckpointRow) -> checkpoints.Tar:
    mtime = _mtime(row)
    config = json.dumps(plan.config, indent=2).encode()
    members = [bytes_member("config.json", config, mtime),
               *(file_member(os.path.join(base_model_dir, f), f) for f in plan.small_files),
               Member(merged_export.WEIGHTS, plan.weights_size,
                      lambda offset: merged_export.weights_chunks(plan, offset), mtime),
               bytes_member(merged_export.NOTES, merged_export.notes(plan, row.tinker_path).encode(), mtime),
               bytes_member(checkpoints.COMPLETE_MARKER, b"", mtime)]
    return checkpoints.tar(members)
