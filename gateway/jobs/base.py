"""A job is what a future runs: one typed class per request kind, with its own `run`.

Its fields are what the future's row stores, so any gateway can run it again from the row
(gateway/futures/store.py re-drives the futures of a gateway that stopped): the gRPC message it sends,
serialized as it is, and typed JSON arguments for what the job records once the service answers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from typing import Any, ClassVar, NamedTuple

from gateway.identity.caller import Caller
from gateway.jobs.context import JobContext


@dataclasses.dataclass
class StoredRequest:
    """A job as its future's row keeps it: JSON arguments and the serialized gRPC message (b"" if none)."""
    args: dict
    body: bytes = b""


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who a job acts for: enough to record and audit what it makes."""
    user_id: str
    org_id: str

    @classmethod
    def of(cls, caller: Caller) -> "Owner":
        return cls(caller.user_id, caller.org_id)


Result = tuple[str, bytes]      # (content type, body) of the future's result


class Done(NamedTuple):
    """A result with what the job writes once it is done, in the transaction that finishes its
    future (exactly once, with no transaction of its own): the usage it did (gateway/usage.py) and
    its other records (`records(connection)`, e.g. gateway/step_metrics.py)."""
    content_type: str
    body: bytes
    usage: Any = None          # gateway.usage.Work, or a function of the connection making one (None: nothing)
    records: Any = None        # a function of the connection


def json_body(obj) -> Result:
    return "application/json", json.dumps(obj).encode()


@dataclasses.dataclass(frozen=True)
class Job:
    """Subclasses are frozen dataclasses: `message` (the gRPC request, when the job sends one)
    and typed arguments; plain values, or dataclasses of plain values."""
    kinds: ClassVar[tuple[str, ...]]            # the request types this job runs
    message_type: ClassVar[type | None] = None  # the class of `message`

    def kind(self) -> str:
        """This request's type (the future's request_type)."""
        return self.kinds[0]

    async def run(self, ctx: JobContext) -> Result:
        raise NotImplementedError

    def stored(self) -> StoredRequest:
        args = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "message"}
        return StoredRequest(args, self.message.SerializeToString() if self.message_type else b"")

    @classmethod
    def from_stored(cls, request: StoredRequest) -> "Job":
        """Raises KeyError or TypeError for a row stored in another shape (an older gateway's)."""
        values = {name: _typed(hint, request.args[name]) for name, hint in _argument_hints(cls)
                  if name in request.args or name not in _defaults(cls)}
        if cls.message_type is not None:
            values["message"] = cls.message_type.FromString(request.body)
        return cls(**values)


@functools.cache
def _argument_hints(cls: type[Job]) -> tuple[tuple[str, Any], ...]:
    """A job class's stored arguments and their types (resolving the hints costs more than the
    rest of decoding a small job, and every submitted request is decoded once)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.name != "message")


@functools.cache
def _defaults(cls: type[Job]) -> frozenset[str]:
    """Arguments with a default: a row stored before they existed runs with the default."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING)


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _typed(hint: Any, value: Any) -> Any:
    """A stored JSON value as its field's type: a dict becomes the field's dataclass."""
    if isinstance(value, dict):
        for candidate in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(candidate):
                return candidate(**value)
    return value
