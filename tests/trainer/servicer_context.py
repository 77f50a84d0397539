"""Calling a trainer servicer method in-process, as gRPC would: `context.abort` raises `Aborted`
with the status code and details kept on the context."""


class Aborted(Exception):
    pass


class Context:
    """A gRPC servicer context with no call metadata (no tenant named: the session is the tenant)."""

    def invocation_metadata(self):
        return ()

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)
