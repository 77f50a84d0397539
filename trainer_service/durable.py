"""Each model's durable state on the trainer's disk: what brings a model back after it was
unloaded, evicted, or lost with a trainer that died.

    <state_dir>/models/<dir_name(model_id)>/state          the newest full checkpoint: adapter,
                                                           AdamW state, step, and the seq_id of the
                                                           last request it includes; swapped in
                                                           whole (checkpoints.commit_state)
    <state_dir>/models/<dir_name(model_id)>/journal.jsonl  one line per forward_backward and
                                                           optim_step executed: seq_id, kind, and
                                                           the optim_step reply
    <state_dir>/models/<dir_name(model_id)>/last_seq       the newest seq_id whose turn came here
                                                           (any kind): where a restarted trainer's
                                                           order of the model's requests resumes

When the state is written (the documented cadence, docs/multi-tenancy.md): when the model is made;
after an optim_step once the last write is older than `--durable-interval-s` (right after its
reply; 0: every step, before its reply); whenever the trainer has been idle for
`--durable-idle-s` (a second; 0: never for idleness); when the model is unloaded or evicted; and
when the trainer stops cleanly (SIGTERM; servicer.write_behind).

What the journal is for, after a restart:
- work lost: entries after the state's seq_id are requests that were executed and answered but
  are not in the state. The model's next request is refused once, naming them and the step the
  model resumed from, so nobody trains on unaware of a gap.
- exactly once: a resent request whose seq_id the state already includes is never applied again;
  an optim_step gets its original reply, a forward_backward a clear error.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import time
import zlib

from tinkerd import paths

STATE, JOURNAL, LAST_SEQ = "state", "journal.jsonl", "last_seq"
_JOURNAL_KEPT = 64          # entries at or before the state's seq_id kept to answer resends
IDLE_WRITE_AFTER_S = 1.0      # --durable-idle-s's default


@dataclasses.dataclass
class Entry:
    seq: int
    kind: str
    reply: bytes | None = None


class DurableModels:
    def __init__(self, state_dir: str, interval_s: float = 10.0):
        self.state_dir = state_dir
        self.interval_s = interval_s
        self._written_at: dict[str, float] = {}     # model_id -> monotonic time of its last write
        self._last_turn: dict[str, int] = {}        # model_id -> the newest seq_id noted (note_turn)
        # Each model's directory, resolved and checked once (paths.model_dir resolves symlinks:
        # several system calls, on every request otherwise), and whether this process made it.
        self._dirs: dict[str, str] = {}
        self._made: set[str] = set()

    # ---- where ----------------------------------------------------------------------------

    def model_dir(self, model_id: str) -> str:
        found = self._dirs.get(model_id)
        if found is None:
            found = self._dirs[model_id] = paths.model_dir(self.state_dir, model_id)
        return found

    def _make_dir(self, model_id: str) -> None:
        if model_id not in self._made:
            os.makedirs(self.model_dir(model_id), exist_ok=True)
            self._made.add(model_id)

    def state_path(self, model_id: str) -> str:
        return os.path.join(self.model_dir(model_id), STATE)

    def exists(self, model_id: str) -> bool:
        from trainer_service.checkpoints import recover_swap

        recover_swap(self.state_path(model_id))
        return os.path.isdir(self.state_path(model_id))

    def remove(self, model_id: str) -> None:
        shutil.rmtree(self.model_dir(model_id), ignore_errors=True)
        self._written_at.pop(model_id, None)
        self._last_turn.pop(model_id, None)
        self._made.discard(model_id)

    # ---- cadence --------------------------------------------------------------------------

    def written(self, model_id: str) -> None:
        self._written_at[model_id] = time.monotonic()

    def due(self, model_id: str) -> bool:
        """After an optim_step: is the model's last write older than the interval?"""
        return time.monotonic() - self._written_at.get(model_id, 0.0) >= self.interval_s

    # ---- journal --------------------------------------------------------------------------

    def _journal_path(self, model_id: str) -> str:
        return os.path.join(self.model_dir(model_id), JOURNAL)

    def record(self, model_id: str, seq: int, kind: str, reply: bytes | None = None) -> None:
        """Appends one executed request. Written before its reply leaves, unbuffered: a killed
        process loses nothing the OS has (a machine crash may lose the last lines)."""
        self._make_dir(model_id)
        line = memoryview(_line(Entry(seq, kind, reply)).encode())
        fd = os.open(self._journal_path(model_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        try:
            while line:                # a short write (a full disk) goes on, or raises
                line = line[os.write(fd, line):]
        finally:
            os.close(fd)

    def note_turn(self, model_id: str, seq: int, *, created: bool = False) -> None:
        """`seq`'s turn came (executed, failed, refused or skipped): the newest one is kept, so
        that a restarted trainer orders the model's next requests after it (seq_order.py). Only
        for a model with a directory (a request of a deleted model must not make it again),
        which the model's creation (`created`, seq 0) makes: its first steps, which a gateway
        may send together (gateway/futures/order.py), are ordered after a restart too. One small
        write in place, at a fixed width, with its checksum (truncating the file first cost ~150
        us a request on ext4: docs/benchmarks.md#in-the-trainer). Not synced: after a machine
        crash it may hold an older seq_id (the model's next requests then wait the gap timeout
        once), or a mix of two writes, which does not check and reads as not there."""
        if seq <= self._last_turn.get(model_id, -1):
            return
        self._last_turn[model_id] = seq
        if created:
            self._make_dir(model_id)
        try:
            fd = os.open(os.path.join(self.model_dir(model_id), LAST_SEQ), os.O_WRONLY | os.O_CREAT, 0o666)
        except FileNotFoundError:
            return                  # no directory: never written, or deleted meanwhile
        try:
            os.pwrite(fd, _last_seq_record(seq), 0)
        finally:
            os.close(fd)

    def next_turn(self, model_id: str) -> int | None:
        """The seq_id after the newest whose turn came in an earlier process, None if unknown."""
        try:
            with open(os.path.join(self.model_dir(model_id), LAST_SEQ), "rb") as f:
                seq = _read_last_seq(f.read())
        except FileNotFoundError:
            return None
        return None if seq is None else seq + 1

    def journal(self, model_id: str) -> list[Entry]:
        try:
            with open(self._journal_path(model_id)) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        entries = []
        for line in lines:
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue            # a line cut short by a crash
            reply = base64.b64decode(d["reply"]) if "reply" in d else None
            entries.append(Entry(int(d["seq"]), d["kind"], reply))
        return entries

    def trim(self, model_id: str, upto_seq: int) -> None:
        """Keeps only the last entries at or before `upto_seq` (the state's): what a resend may
        still ask for. Entries after it are dropped: lost work, already reported."""
        kept = [e for e in self.journal(model_id) if e.seq <= upto_seq][-_JOURNAL_KEPT:]
        path = self._journal_path(model_id)
        if not kept:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            return
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(_line(e) for e in kept)
        os.replace(tmp, path)


def _last_seq_record(seq: int) -> bytes:
    """last_seq's content: the seq_id in 20 digits and their CRC-32 (every write the same width,
    so each covers the last one whole)."""
    digits = b"%020d" % seq
    return b"%s %08x\n" % (digits, zlib.crc32(digits))


def _read_last_seq(data: bytes) -> int | None:
    """The seq_id in last_seq, None if it does not check. A bare number without leading zeros is
    an older trainer's (a record cut short in its digits has them, and does not check)."""
    if data.isdigit() and (data == b"0" or not data.startswith(b"0")):
        return int(data)
    digits, _, crc = data.rstrip(b"\n").partition(b" ")
    if not digits.isdigit() or crc != b"%08x" % zlib.crc32(digits):
        return None
    return int(digits)


def _line(entry: Entry) -> str:
    """One journal line: JSON, the reply base64-encoded."""
    line = {"seq": entry.seq, "kind": entry.kind}
    if entry.reply is not None:
        line["reply"] = base64.b64encode(entry.reply).decode()
    return json.dumps(line) + "\n"


def describe_lost(entries: list[Entry]) -> str:
    """`forward_backward seq_id 3, 4; optim_step seq_id 5` for an error message."""
    by_kind: dict[str, list[str]] = {}
    for e in entries:
        by_kind.setdefault(e.kind, []).append(str(e.seq))
    return "; ".join(f"{kind} seq_id {', '.join(seqs)}" for kind, seqs in by_kind.items())
