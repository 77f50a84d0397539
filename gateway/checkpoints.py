"""Checkpoints: their tinker:// paths, where their files live, what the registry shows of them,
expiry, and copies.

A training run is a model (`{session_id}:train:{n}`); its checkpoints are database rows with
their files on disk: `weights/<name>` (PEFT adapter + optimizer state, from save_state),
`sampler_weights/<name>` (the adapter a sampler serves), `external_weights/<name>` (files the
gateway serves over plain GET). Checkpoint ids contain a slash, run ids colons.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import shutil
import tarfile
import urllib.parse
from typing import Callable, Iterator, Sequence

from sqlalchemy import select

from gateway import protocol, usage
from gateway.identity import audit
from gateway.identity.tokens import DownloadGrant
from gateway.storage.db import CheckpointRow, Database, ModelRow, UserRow, aware, now
from tinkerd import paths
from tinkerd.errors import UserError

log = logging.getLogger(__name__)

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
CHECKPOINT_ROUTE = "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}"     # the REST routes of one


def checkpoint_name(name: str | None) -> str:
    """The `path` a client named a checkpoint by (it becomes a directory: tinkerd/paths.py)."""
    try:
        return paths.checked_name(name)
    except UserError as e:
        raise UserError(f"path: {e}") from None


def tinker_path(run_id: str, kind: str, name: str) -> str:
    return f"tinker://{run_id}/{kind}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """tinker://<run>/<kind>/<name> -> (run, kind, name); a user error if it is not one."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"{path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise UserError(f"{path!r} is not a checkpoint path (tinker://<run>/<weights|sampler_weights|"
                        f"external_weights>/<name>)")
    return parts[0], parts[1], parts[2]


def download_path(run_id: str, checkpoint_id: str, relative: str) -> str:
    """The URL path of one file of an external_weights checkpoint: what its download URL signs
    (routes/checkpoints.py) and what the files route checks (routes/files.py)."""
    return urllib.parse.quote(f"/files/{run_id}/{checkpoint_id}/{relative}")


ARCHIVE_FILES = {"peft": "archive.tar", "merged": "merged.tar"}


def archive_path(run_id: str, checkpoint_id: str, format: str = "peft") -> str:
    """The URL path of a checkpoint's tar archive (SDKs up to 0.35: get_checkpoint_archive_url),
    as trained (`peft`) or merged into the base model (`merged`, gateway/export.py): what its
    download URL signs and what the files route checks."""
    return urllib.parse.quote(f"/files/{run_id}/{checkpoint_id}/{ARCHIVE_FILES[format]}")


def download_grant(row: CheckpointRow, path: str, expires: int, user_id: str, key_id: str) -> DownloadGrant | None:
    """What a download URL of `row`'s `path` made by `user_id` (with API key `key_id`) signs, as
    of the row now; None when that user may not read the row (another's, unpublished). The row's
    generation is its creation time: a checkpoint deleted and saved again, or overwritten, has a
    new one, so the old row's URLs never serve the new files."""
    access = "owner" if row.owner == user_id else "public" if row.public else None
    if access is None:
        return None
    return DownloadGrant(path, expires, key_id, generation(row.created_at), row.owner or "", access)


def generation(created_at) -> str:
    """A row's generation in a download grant: its creation time (a row made again has another)."""
    created = created_at and aware(created_at)
    return f"{created:%Y%m%dT%H%M%S.%f}" if created else "-"


# The file the SDK's `tinker checkpoint` CLI (<= 0.35) insists on finding in an archive. Our
# checkpoint rows exist only once their files are complete, so every archive carries it.
COMPLETE_MARKER = "checkpoint_complete"
_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class Member:
    """One file of an archive: its name, size, and its bytes from an offset on, as they are sent
    (an offset, so a ranged download starts where it asks without making what comes before)."""
    name: str
    size: int
    chunks: Callable[[int], Iterator[bytes]]
    mtime: int = 0          # its source's: the same checkpoint downloads as the same bytes


def file_member(path: str, name: str) -> Member:
    def chunks(offset: int) -> Iterator[bytes]:
        with open(path, "rb") as f:      # checkpoint files never change
            f.seek(offset)
            while chunk := f.read(1 << 20):
                yield chunk
    stat = os.stat(path)
    return Member(name, stat.st_size, chunks, int(stat.st_mtime))


def bytes_member(name: str, data: bytes, mtime: int = 0) -> Member:
    return Member(name, len(data), lambda offset: iter((data[offset:],)), mtime)


def archive(directory: str, extra: Sequence[Member] = ()) -> Tar:
    """An uncompressed tar of the checkpoint's files at its root, plus `extra` and the completion
    marker, made as it is sent (no copy on disk, no whole file in memory)."""
    members = [file_member(os.path.join(directory, rel), rel)
               for rel in sorted(os.path.relpath(os.path.join(root, f), directory)
                                 for root, _, names in os.walk(directory) for f in names)
               if rel != COMPLETE_MARKER]
    return tar([*members, *extra, bytes_member(COMPLETE_MARKER, b"")])


@dataclasses.dataclass(frozen=True)
class Tar:
    """An uncompressed tar of `members`: `size` bytes, any range of which `chunks` makes as it is
    sent. Its layout is known from the members' sizes alone, so a range skips whole members."""
    size: int
    parts: list[tuple[int, bytes | Member]]        # (offset, a header / padding, or a member's bytes)

    def chunks(self, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Bytes [start, end) of the tar. A member whose bytes come out another size than it said
        ends the stream with an error (a short, broken download, never a tar whose files are
        silently wrong)."""
        end = self.size if end is None else end
        for offset, part in self.parts:
            size = part.size if isinstance(part, Member) else len(part)
            if offset + size <= start or size == 0:
                continue
            if offset >= end:
                return
            first, last = max(start - offset, 0), min(end - offset, size)
            if isinstance(part, Member):
                yield from _member_bytes(part, first, last)
            else:
                yield part[first:last]


def _member_bytes(m: Member, first: int, last: int) -> Iterator[bytes]:
    at, chunks = first, m.chunks(first)
    for chunk in chunks:
        if at + len(chunk) >= last:
            # At the member's end: no byte past it either (a file that grew since it was sized).
            if at + len(chunk) > m.size or (last == m.size and any(chunks)):
                break
            yield chunk[:last - at]
            return
        at += len(chunk)
        yield chunk
    raise RuntimeError(f"archive member {m.name} did not come out {m.size} bytes")


def tar(members: list[Member]) -> Tar:
    """A PAX tar of `members`, laid out (nothing is read until its chunks are)."""
    parts: list[tuple[int, bytes | Member]] = []
    offset = 0
    for m in members:
        info = tarfile.TarInfo(m.name)
        info.size, info.mtime, info.mode = m.size, m.mtime, 0o644
        for part in (info.tobuf(tarfile.PAX_FORMAT), m, b"\0" * (-m.size % _BLOCK)):
            parts.append((offset, part))
            offset += part.size if isinstance(part, Member) else len(part)
    parts.append((offset, b"\0" * (2 * _BLOCK)))
    return Tar(offset + 2 * _BLOCK, parts)


def checkpoint_dir(state_dir: str, model_id: str, kind: str, name: str) -> str:
    """The trainer derives the same directory from the same ids (tinkerd/paths.py)."""
    return paths.checkpoint_dir(state_dir, model_id, kind, name)


def expires(ttl_seconds: int | None) -> datetime.datetime | None:
    if ttl_seconds is None:
        return None
    if ttl_seconds <= 0:
        raise UserError(f"ttl_seconds must be positive, got {ttl_seconds}")
    return now() + datetime.timedelta(seconds=ttl_seconds)


def iso(t: datetime.datetime | None) -> str | None:
    return None if t is None else aware(t).isoformat()


def _finite(value):
    """Metadata stored before the edge refused NaN/inf (JSON cannot carry them): those become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def checkpoint_json(row: CheckpointRow) -> protocol.Checkpoint:
    return protocol.Checkpoint(
        checkpoint_id=row.checkpoint_id, checkpoint_type=row.checkpoint_type, time=iso(row.created_at),
        tinker_path=row.tinker_path, size_bytes=row.size_bytes, public=bool(row.public),
        user_metadata=_finite(row.user_metadata) or None, expires_at=iso(row.expires_at))


def last_checkpoint(db: Database, run_id: str, checkpoint_type: str) -> protocol.Checkpoint | None:
    rows = db.select(select(CheckpointRow).where(CheckpointRow.model_id == run_id,
                                                 CheckpointRow.checkpoint_type == checkpoint_type)
                     .order_by(CheckpointRow.created_at.desc()).limit(1))
    return checkpoint_json(rows[0]) if rows else None


def run_json(db: Database, row: ModelRow) -> protocol.TrainingRun:
    return protocol.TrainingRun(
        training_run_id=row.model_id, base_model=row.base_model, model_owner=f"tml:organization_user:{row.owner}",
        lora_rank=row.lora_rank, last_request_time=iso(row.last_request_time),
        last_checkpoint=last_checkpoint(db, row.model_id, "training"),
        last_sampler_checkpoint=last_checkpoint(db, row.model_id, "sampler"))


def delete_checkpoint_files(row: CheckpointRow) -> None:
    for path in {row.directory, row.snapshot_path} - {""}:
        shutil.rmtree(path, ignore_errors=True)


def delete_expired_checkpoints(db: Database) -> int:
    """Checkpoints past their ttl: rows and files go. Run by the gateway's housekeeping loop."""
    expired = db.select(select(CheckpointRow).where(CheckpointRow.expires_at.is_not(None),
                                                    CheckpointRow.expires_at < now()))
    deleted = 0
    for row in expired:
        if not db.delete(CheckpointRow, row.tinker_path):
            continue                  # another gateway's housekeeping took it (and records it)
        usage.checkpoint_gone(db, row.tinker_path)
        delete_checkpoint_files(row)
        owner = db.get(UserRow, row.owner) if row.owner else None
        audit.record(db, "checkpoint_expired", user_id=row.owner or "", org_id=owner.org_id if owner else "",
                     model_id=row.model_id, tinker_path=row.tinker_path)
        log.info("deleted expired checkpoint %s", row.tinker_path)
        deleted += 1
    return deleted


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)            # shares the bytes; deleting either side leaves the other intact
    except OSError:
        shutil.copy2(src, dst)       # another filesystem


def copy_checkpoint(db: Database, state_dir: str, source: CheckpointRow, run_id: str, session_id: str,
                    ttl_seconds: int | None, *, owner: str, admit=None) -> str:
    """A copy of `source` as the only checkpoint of a new training run `run_id` that cannot be
    trained on (it has no model on the trainer). Files are hard links. Returns its tinker path.
    `admit` checks the owner's quota with the new row counted (gateway/identity/limits.py): a
    refused copy leaves nothing behind."""
    source_run = db.get(ModelRow, source.model_id)
    kind, name = source.checkpoint_id.split("/", 1)
    directory = checkpoint_dir(state_dir, run_id, kind, name)
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(source.directory, directory, copy_function=_link_or_copy)
    db.add(ModelRow(model_id=run_id, session_id=session_id, owner=owner, base_model=source_run.base_model,
                    lora_rank=source_run.lora_rank, resident=False, optimizer=source_run.optimizer,
                    lora_config={**(source_run.lora_config or {}), "copied_from": source.tinker_path}))
    path = tinker_path(run_id, kind, name)
    row = CheckpointRow(tinker_path=path, model_id=run_id, owner=owner, checkpoint_type=source.checkpoint_type,
                        name=name, snapshot_id=source.snapshot_id,
                        snapshot_path=directory if source.snapshot_path else "", directory=directory,
                        size_bytes=source.size_bytes, expires_at=expires(ttl_seconds), created_at=now())
    try:
        if admit is None:
            db.add(row)
        else:
            db.add_admitted(row, admit)
    except Exception:
        db.delete(ModelRow, run_id)
        shutil.rmtree(directory, ignore_errors=True)
        raise
    log.info("copied %s to %s", source.tinker_path, path)
    return path
