"""Stability records for `stable_reinforce`: what the sampler produced, kept by `sequence_id`.

A sampling client made with `record_stability_info=True` has every sampled sequence recorded
here (its tokens and the sampler's logprobs). A `stable_reinforce` forward_backward names,
through the datum's provenance spans, which sampled sequence each target position reproduces;
the trainer then gets the sampler's own logprobs for those positions (not whatever the client
sent), and a span whose tokens differ from what was sampled is refused. Records belong to the
session that sampled them and expire after a period without use, as in Tinker.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from tinkerd.errors import UserError


@dataclasses.dataclass
class _Record:
    session_id: str
    tokens: np.ndarray        # int64, the sampled tokens
    logprobs: np.ndarray      # float32, the sampler's logprob of each
    used: float


@dataclasses.dataclass(frozen=True)
class Span:
    """One run of a datum's loss_fn_input_spans: `length` positions that are positions
    [offset, offset + length) of a sampled sequence (sampled=True) or of a request's prompt."""
    sampled: bool
    sequence_id: str
    offset: int
    length: int


class StabilityRecords:
    def __init__(self, ttl_s: float = 3600.0, max_sequences: int = 1_000_000):
        self.ttl_s = ttl_s
        self.max_sequences = max_sequences
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, session_id: str, sequence_id: str, tokens, logprobs) -> None:
        self._records[sequence_id] = _Record(session_id, np.asarray(tokens, dtype=np.int64),
                                             np.asarray(logprobs, dtype=np.float32), time.monotonic())
        self._records.move_to_end(sequence_id)
        while len(self._records) > self.max_sequences:
            self._records.popitem(last=False)

    def expire(self) -> int:
        """Drops records unused for ttl_s; returns how many."""
        cutoff = time.monotonic() - self.ttl_s
        stale = [k for k, r in self._records.items() if r.used < cutoff]
        for k in stale:
            del self._records[k]
        return len(stale)

    def behaviour_logprobs(self, session_id: str, datum: int, spans: list[Span], targets: np.ndarray,
                           client_logprobs: np.ndarray | None) -> np.ndarray:
        """The sampler's logprob for every target position a sampled span covers; positions
        covered by prompt spans keep the client's value (0 where it sent none)."""
        where = f"datum {datum}"
        if not spans:
            raise UserError(f"{where}: stable_reinforce needs provenance (Datum.with_provenance) naming the "
                            f"sampled sequences, sampled with record_stability_info=True")
        if sum(s.length for s in spans) != len(targets):
            raise UserError(f"{where}: loss_fn_input_spans cover {sum(s.length for s in spans)} positions but "
                            f"target_tokens has {len(targets)}")
        out = (np.zeros(len(targets), np.float32) if client_logprobs is None
               else np.asarray(client_logprobs, np.float32).reshape(-1).copy())
        pos = 0
        now = time.monotonic()
        for span in spans:
            if span.sampled:
                rec = self._records.get(span.sequence_id)
                if rec is None or rec.session_id != session_id:
                    raise UserError(f"{where}: no stability record for sequence {span.sequence_id!r} in this "
                                    f"session (sample with record_stability_info=True; records expire after "
                                    f"{self.ttl_s:.0f} s unused)")
                end = span.offset + span.length
                if end > len(rec.tokens):
                    raise UserError(f"{where}: span [{span.offset}, {end}) is past the {len(rec.tokens)} tokens "
                                    f"sampled in {span.sequence_id!r}")
                if not np.array_equal(rec.tokens[span.offset:end], targets[pos:pos + span.length]):
                    raise UserError(f"{where}: target_tokens [{pos}, {pos + span.length}) are not the tokens "
                                    f"sampled at [{span.offset}, {end}) of {span.sequence_id!r}")
                out[pos:pos + span.length] = rec.logprobs[span.offset:end]
                rec.used = now
            pos += span.length
        return out

    def apply(self, fb, session_id: str) -> None:
        """Puts the recorded sampler logprobs into a decoded stable_reinforce request
        (gateway.convert.ForwardBackward), in place."""
        for i, datum in enumerate(fb.data):
            if "target_tokens" not in datum.inputs:
                raise UserError(f"datum {i}: loss_fn_inputs is missing 'target_tokens'")
            targets = datum.inputs["target_tokens"].reshape(-1)
            client = datum.inputs.get("logprobs")
            if client is not None and client.size != targets.size:
                raise UserError(f"datum {i}: logprobs has {client.size} values, target_tokens {targets.size}")
            datum.inputs["logprobs"] = self.behaviour_logprobs(session_id, i, datum.spans, targets, client)
