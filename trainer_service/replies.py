"""Replies by (model_id, seq_id), so a resent request is answered, not re-executed."""

from __future__ import annotations

import collections
import threading

from tinkerd.errors import UserError

_REPLIES_KEPT_PER_MODEL = 256
# Stands for the reply of a request that was applied but whose reply was not kept (a
# forward_backward from before a trainer restart): a resend must not apply it again.
APPLIED = object()


class ReplyCache:
    def __init__(self):
        self._by_model: dict[str, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
        self._lock = threading.Lock()

    def get(self, model_id: str, seq_id: int, kind: str):
        with self._lock:      # (not _by_model[model_id]: a lookup must not leave an entry behind)
            hit = self._by_model.get(model_id, {}).get(seq_id)
        if hit is None:
            return None
        if hit[0] != kind:
            raise UserError(f"seq_id {seq_id} of {model_id} was already used by a {hit[0]} request")
        if hit[1] is APPLIED:
            raise UserError(f"{kind} seq_id {seq_id} of {model_id} was applied before the trainer restarted "
                            f"and its result was not kept; it is not applied twice")
        return hit[1]

    def put(self, model_id: str, seq_id: int, kind: str, reply) -> None:
        with self._lock:
            replies = self._by_model[model_id]
            replies[seq_id] = (kind, reply)
            while len(replies) > _REPLIES_KEPT_PER_MODEL:
                replies.popitem(last=False)

    def once(self, model_id: str, seq_id: int, kind: str, compute):
        """The stored reply for (model_id, seq_id), else `compute()`'s, stored."""
        cached = self.get(model_id, seq_id, kind)
        if cached is None:
            cached = compute()
            self.put(model_id, seq_id, kind, cached)
        return cached

    def forget(self, model_id: str) -> None:
        with self._lock:
            self._by_model.pop(model_id, None)
