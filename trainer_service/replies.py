"""Replies by (model_id, seq_id), so a resent request is answered, not re-executed.

Kept within byte budgets, not counts: one forward_backward's reply holds two floats per token
(up to megabytes). Each model keeps its latest replies up to PER_MODEL_BYTES (at least its newest
one, and at most _REPLIES_KEPT_PER_MODEL), and all models together up to TOTAL_BYTES, where the
model holding the most gives up its oldest first: one busy model cannot push out everyone's. A
resend whose reply was dropped is refused, not re-executed (ledger.py, seq_order.py).
"""

from __future__ import annotations

import collections
import threading

from tinkerd.errors import UserError

_REPLIES_KEPT_PER_MODEL = 256
PER_MODEL_BYTES = 64 << 20
TOTAL_BYTES = 1 << 30
# Stands for the reply of a request that was applied but whose reply was not kept (a
# forward_backward from before a trainer restart): a resend must not apply it again.
APPLIED = object()
_ENTRY_BYTES = 64        # what an entry costs beyond its reply (keys, tuple)


def _size(reply) -> int:
    return _ENTRY_BYTES + (reply.ByteSize() if hasattr(reply, "ByteSize") else 0)


class _Replies:
    def __init__(self):
        self.by_seq: collections.OrderedDict[int, tuple[str, object, int]] = collections.OrderedDict()
        self.bytes = 0

    def pop_oldest(self) -> int:
        _, (_, _, size) = self.by_seq.popitem(last=False)
        self.bytes -= size
        return size


class ReplyCache:
    def __init__(self, per_model_bytes: int = PER_MODEL_BYTES, total_bytes: int = TOTAL_BYTES):
        self.per_model_bytes = per_model_bytes
        self.total_bytes = total_bytes
        self._by_model: dict[str, _Replies] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, model_id: str, seq_id: int, kind: str):
        with self._lock:
            replies = self._by_model.get(model_id)
            hit = replies.by_seq.get(seq_id) if replies is not None else None
        if hit is None:
            return None
        if hit[0] != kind:
            raise UserError(f"seq_id {seq_id} of {model_id} was already used by a {hit[0]} request")
        if hit[1] is APPLIED:
            raise UserError(f"{kind} seq_id {seq_id} of {model_id} was applied before the trainer restarted "
                            f"and its result was not kept; it is not applied twice")
        return hit[1]

    def put(self, model_id: str, seq_id: int, kind: str, reply) -> None:
        size = _size(reply)
        with self._lock:
            replies = self._by_model.setdefault(model_id, _Replies())
            old = replies.by_seq.pop(seq_id, None)
            if old is not None:
                replies.bytes -= old[2]
                self._bytes -= old[2]
            replies.by_seq[seq_id] = (kind, reply, size)
            replies.bytes += size
            self._bytes += size
            while len(replies.by_seq) > 1 and (len(replies.by_seq) > _REPLIES_KEPT_PER_MODEL
                                               or replies.bytes > self.per_model_bytes):
                self._bytes -= replies.pop_oldest()
            while self._bytes > self.total_bytes:
                heaviest = max(self._by_model, key=lambda m: self._by_model[m].bytes)
                self._bytes -= self._by_model[heaviest].pop_oldest()
                if not self._by_model[heaviest].by_seq:
                    del self._by_model[heaviest]

    @property
    def bytes(self) -> int:
        return self._bytes

    def forget(self, model_id: str) -> None:
        with self._lock:
            replies = self._by_model.pop(model_id, None)
            if replies is not None:
                self._bytes -= replies.bytes
