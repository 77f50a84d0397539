"""Calling a trainer servicer method in-process, as gRPC would: `answered(servicer.Method)` runs
it inside the boundary a server made by tinkerd.rpc.create_server puts around every call, where
`context.abort` raises `Aborted` with the status code and details kept on the context."""

from tinkerd import rpc


class Aborted(Exception):
    pass


class Context:
    """A gRPC servicer context with no call metadata (no tenant named: the session is the tenant)."""

    def __init__(self):
        self._code, self._details = None, ""

    def invocation_metadata(self):
        return ()

    def abort(self, code, details):
        self._code, self._details = code, details
        raise Aborted(details)

    def code(self):
        return self._code

    def details(self):
        return self._details


def answered(method):
    """A trainer servicer's bound method as its server runs a call of it (tinkerd.rpc.answering)."""
    return rpc.answering(method, f"/tinkerd.v1.Trainer/{method.__name__}")
