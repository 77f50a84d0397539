"""What a checkpoint archive holds besides the checkpoint's own files: TINKERD_EXPORT.md, which
says how to load the adapter elsewhere and when to take the merged export instead; and the
merged export itself (`?format=merged`: tinkerd/merged_export.py), a full model directory."""

from __future__ import annotations

import json
import os
import threading
import weakref
from typing import Iterator

from gateway import checkpoints
from gateway.checkpoints import Member, bytes_member, file_member
from gateway.identity.limits import OverLimit
from gateway.storage.db import CheckpointRow
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
# this many are made at once on a gateway, and one per checkpoint owner (two slow downloads of one
# user's checkpoints must not block everyone's); another download meanwhile is a 429.
MAX_MERGED_EXPORTS = 2
MAX_MERGED_EXPORTS_PER_OWNER = 1
_merging: weakref.WeakSet = weakref.WeakSet()    # their streams: one dropped unread frees its place
_merging_lock = threading.Lock()


def merged_archive(base_model_dir: str, row: CheckpointRow) -> checkpoints.Tar:
    """The merged export's tar, laid out: nothing is merged until its chunks are read, through
    `merging`."""
    return _merged_tar(base_model_dir, merged_plan(base_model_dir, row), row)


def merging(chunks: Iterator[bytes], owner: str | None) -> Iterator[bytes]:
    """A merged archive's chunks (or a range of them), counted among the exports being made
    until they end; an OverLimit where MAX_MERGED_EXPORTS are being made already, or
    MAX_MERGED_EXPORTS_PER_OWNER of the checkpoint owner's."""
    with _merging_lock:
        if len(_merging) >= MAX_MERGED_EXPORTS:
            raise OverLimit(f"{len(_merging)} merged exports are being made on this gateway (the limit is "
                            f"{MAX_MERGED_EXPORTS}); retry when one has finished", retry_after_s=30)
        if sum(s.owner == owner for s in _merging) >= MAX_MERGED_EXPORTS_PER_OWNER:
            raise OverLimit(f"a merged export of this user's checkpoints is being made already (the limit is "
                            f"{MAX_MERGED_EXPORTS_PER_OWNER} at a time); retry when it has finished", retry_after_s=30)
        stream = _Merging(chunks, owner)
        _merging.add(stream)
    return stream


class _Merging:
    """A merged archive's chunks, counted among those being made until they end (sent, failed,
    or dropped unread: then the WeakSet forgets it)."""

    def __init__(self, chunks: Iterator[bytes], owner: str | None):
        self._chunks, self.owner = chunks, owner

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._chunks)
        except BaseException:
            with _merging_lock:
                _merging.discard(self)
            raise


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
